// Where a run's time went, from its node spans (engine/trace.hpp): what `run.profile: true`
// prints and writes as OUT_DIR/profile.json at the end of a run, and what
// `flowrun dot --trace TRACE GRAPH` draws on the graph. Test: tests/engine/profile_test.cpp.
//
// The input is one span per node instance (node, step, start, end, thread) with the instances
// the executor made it wait for (its `deps`: producers of its values, its own previous step,
// the state accesses it must follow). From them, per node:
//
//   runs, mean, p50, p95, max, total   of its spans' durations ("per active step": a node
//                                       that runs every 100 steps has one run per 100 steps)
//   share                               total / the run's wall time (first start to last end)
//   overlapped                          of total, the time at least one other node ran too
//   waited                              time it was free but an input was not: per run,
//                                       max(0, the last input's end - when it was free), free =
//                                       its own previous run done and its step begun (the step's
//                                       first instance started); 0 for nodes that may run steps
//                                       at once (stateless: no own previous run)
//
// Each run's wait is charged to the dependency that ended last (which node, and whether of the
// same step): `waits`, the edges of `flowrun dot --trace`.
//
// The critical path of a step: from the step's last-ending instance, walk back through the
// dependency that ended last while it stays in the same step; the path starts at an instance
// whose last dependency is of an earlier step (or that has none). The profile's path is the
// most frequent one over the steps ("typical"), with how many steps had it.
//
// Workers: the threads that ran node spans; idle = 1 - node time / (threads x wall).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "trace.hpp"

namespace flowrun {

struct GraphSpec;

struct NodeProfile {
  std::string name, type;
  int64_t runs = 0;
  double mean_us = 0, p50_us = 0, p95_us = 0, max_us = 0, total_us = 0;
  double share = 0;          // total / wall
  double overlapped_us = 0;  // of total
  double waited_us = 0;      // on inputs, in total
};

// Time runs of `to` waited because `from` (of the same step, or an earlier one) ended last.
struct DependencyWait {
  std::string from, to;
  bool same_step = true;
  double total_us = 0;
  int64_t runs = 0;  // runs of `to` it made wait
};

struct Profile {
  double wall_us = 0;
  int64_t steps = 0;
  int threads = 0;
  double idle_fraction = 0;
  std::vector<NodeProfile> nodes;  // in file order, the nodes that ran
  std::vector<DependencyWait> waits;
  std::vector<std::string> critical_path;  // node names, first to last
  int64_t critical_path_steps = 0;         // steps whose path this was
  double critical_path_us = 0;             // its mean length on those steps (first start to last end)

  const NodeProfile* node(const std::string& name) const;
  // Mean wait per run of `to` charged to (from -> to), over all runs of `to`; 0 when none.
  double mean_wait_us(const std::string& from, const std::string& to) const;
};

// The node spans of a Chrome trace flowrun wrote (run.trace); errors name the file.
std::vector<TraceSpan> read_trace_file(const std::string& path);

// Throws when a span's node is not in g or has another type there (the trace and the graph do
// not belong together), naming both sets of nodes ("name : type").
Profile make_profile(const GraphSpec& g, const std::vector<TraceSpan>& spans);

std::string profile_table(const Profile& p);  // the text `run.profile` logs
std::string profile_json(const Profile& p);   // OUT_DIR/profile.json

}  // namespace flowrun
