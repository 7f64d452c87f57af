// GraphSpec: a checked graph file. Built by load_graph() (parse.cpp: file, overrides and
// substitution; check.cpp: schema and wiring rules). Pure data; the executor builds from it.
#pragma once
#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <string>
#include <vector>

#include "diag.hpp"
#include "schema.hpp"

namespace flowrun {

class Registry;

// One `node.port` an input names.
struct PortRef {
  std::string node, port;
  int node_index = -1;  // index into GraphSpec::nodes
  Mark mark;
  std::string str() const { return node + "." + port; }
};

struct InputSpec {
  std::string port;           // the consumer's port name
  std::vector<PortRef> refs;  // one, or several for a `many` port
  const PortSchema* schema = nullptr;  // the consumer's port (into NodeType::schema, owned by the registry)
  Mark mark;
};

// When a periodic node runs: every N steps (steps N, 2N, ...) and/or at the start/end.
struct Schedule {
  int64_t every = 0;  // 0: not by period
  bool at_start = false, at_end = false;
  bool at_stop = false;  // once more after a stopped run's last step (Ctrl-C, SIGTERM): executor.cpp
  bool periodic() const { return every > 0 || at_start || at_end || at_stop; }
  // Steps are 1-based; first/last are the first and last step of this run.
  bool active(int64_t step, int64_t first, int64_t last) const {
    if (!periodic()) return true;
    return (every > 0 && step % every == 0) || (at_start && step == first) || (at_end && step == last);
  }
  std::string str() const;  // "every 500, at end"
};

struct NodeSpec {
  std::string name, type;
  Mark mark;
  std::vector<InputSpec> inputs;  // file order
  YAML::Node params;              // `with:` checked, defaults filled
  Schedule schedule;
  std::string stream;             // "" = default stream
  std::string origin;             // "built-in" or plugin path
  const InputSpec* input(const std::string& port) const;
};

// The graph's `run:` section, typed: check_graph() fills it from the checked section, so every
// value here is the file's or its default from schemas/graph.yaml (the one source of defaults:
// the zeros below are never used). GraphSpec::run keeps the same settings as YAML, for
// --print-config and the checkpoints' manifests. Adding a key to the schema's run group means
// adding its field here and its line in run_settings() (check.cpp; RunSettings.* tests).
struct RunSettings {
  int64_t steps = 0;
  uint64_t seed = 0;
  std::string device;     // as written: auto, cpu, cuda, cuda:N (nodes/common/device.hpp resolves it)
  std::string precision;  // fp32, bf16
  int prefetch = 0;
  std::string out_dir;    // never empty: runs/NAME when the file leaves it empty
  int log_every = 0;
  int threads = 0;        // 0: the cores (shared by the ranks on a machine)
  int workers = 0;        // 0: the cores
  bool compute_thread = false;
  bool cuda_graph = false;  // forward_backward's CUDA graph (train/forward_backward.cpp)
  std::string cpu_gemm;     // auto, libtorch, openblas (nodes/common/cpu_blas.hpp)
  std::string trace;      // "" = none
  bool profile = false;
  std::string progress;   // auto, on, off
  int stop_grace_s = 0;   // 0 = no limit
  std::string resume;     // "", auto, never or a checkpoint folder
  double comm_timeout_s = 0;
  double heartbeat_timeout_s = 0;
  // run.parallel: the mesh's tensor- and pipeline-parallel sizes (nodes/parallel/mesh.hpp); the
  // data-parallel size is what the world leaves, and ep (expert parallel) is cut out of it.
  struct Parallel {
    int tp = 1, pp = 1, ep = 1;
    // Pipeline parallel (pp > 1; nodes/parallel/pipeline_schedule.hpp).
    int microbatches = 1;
    std::string schedule = "1f1b";  // gpipe, 1f1b, interleaved, zero_bubble
    int virtual_stages = 1;
    std::vector<int> stage_layers;  // empty: balanced by cost
  } parallel;
};

struct GraphSpec {
  std::string file;  // as given
  std::string dir;   // the file's folder (plugin paths are relative to it)
  std::string name;
  YAML::Node root;   // the resolved document (overrides and substitutions applied)
  YAML::Node run;    // run: checked, defaults filled (as YAML; `settings` is the same, typed)
  RunSettings settings;
  std::vector<std::string> plugins;  // resolved paths
  std::vector<NodeSpec> nodes;       // file order = program order
  std::vector<std::string> overrides;

  int index_of(const std::string& node) const;
  int64_t steps() const { return settings.steps; }
};

// Read FILE, apply `key.path=value` overrides, substitute ${ENV:-default} and ${run.x}.
// Bad overrides and unset variables go to `diags` (so the checker can add its own); throws
// GraphError only when there is no document to check (unreadable file, YAML syntax error).
YAML::Node parse_graph_file(const std::string& file, const std::vector<std::string>& overrides, Diagnostics& diags);

// Check a parsed document against the graph schema and the registry's node schemas, loading
// the plugins it names into `reg` first. Every error is collected; throws GraphError if any.
GraphSpec check_graph(const YAML::Node& root, const std::string& file, const std::vector<std::string>& overrides,
                      Registry& reg);

// The typed settings of a checked `run:` section (every key present, as check_graph leaves it).
// Throws naming a key the schema has and RunSettings lacks (a flowrun bug).
RunSettings run_settings(const YAML::Node& run);

// parse_graph_file + check_graph.
GraphSpec load_graph(const std::string& file, const std::vector<std::string>& overrides, Registry& reg);

// The resolved document: overrides and substitutions applied, every run key and node parameter
// filled in with its default (--print-config prints it; checkpoints save it).
YAML::Node resolved_config(const GraphSpec& g);
std::string to_yaml(const YAML::Node& root);

}  // namespace flowrun
