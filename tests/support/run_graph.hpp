// Run a graph given as YAML text, for tests: written to a fresh temporary folder, run with
// run.out_dir there and the progress line off; returns what a test wants to look at.
#pragma once
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "executor.hpp"
#include "spec.hpp"

namespace flowrun::test {

struct RunResult {
  std::string dir;      // the temporary folder (graph.yaml is in it)
  std::string out_dir;  // run.out_dir
  std::vector<nlohmann::json> metrics;  // lines of OUT_DIR/metrics.jsonl
  RunStats stats;
};

// A new empty folder under the build's temporary area.
std::string temp_dir(const std::string& prefix = "t");

// `opt` gives the tracer, stop flag and callbacks; prefetch and workers come from the graph.
RunResult run_graph_text(const std::string& yaml, const std::vector<std::string>& overrides = {},
                         const RunOptions& opt = {});

// A graph file given as YAML text, written to a fresh temporary file and loaded (parsed and
// checked, not run) with the test node types registered: its spec, or every diagnostic.
struct CheckedGraph {
  bool ok = false;
  std::vector<Diagnostic> diags;
  GraphSpec spec;
  std::string file;  // where the text was written (the diagnostics name it)
  std::string all;   // every diagnostic, one per line
};
CheckedGraph check_graph_text(const std::string& yaml, const std::vector<std::string>& overrides = {});

// The first diagnostic whose message contains `needle`; a test failure listing them all if none.
const Diagnostic& find_diagnostic(const CheckedGraph& g, const std::string& needle);

// Run the flowrun binary of this build folder with `args` (each passed as one argument),
// stdout and stderr to `log`; its exit code (-1 if it did not exit).
int run_flowrun(const std::vector<std::string>& args, const std::string& log);

// Read a JSON-lines file.
std::vector<nlohmann::json> read_jsonl(const std::string& path);

}  // namespace flowrun::test
