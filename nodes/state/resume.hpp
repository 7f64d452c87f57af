// Resuming a run from a checkpoint (run.resume): which checkpoint, and loading it into the
// executor's state objects. Torch-free interface: the CLI includes it.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

namespace flowrun {

class Executor;
struct GraphSpec;

struct ResumePoint {
  std::string folder;  // the checkpoint folder (with manifest.json)
  int64_t step = 0;    // the run continues at step + 1
};

// run.resume (schemas/graph.yaml):
//   ""     start at step 1; refused when a checkpoint node's folder already holds step folders
//          (they would be replaced);
//   never  start at step 1 anyway (the checkpoint node deletes the old folders at setup);
//   auto   `latest`, or when it is missing, empty or names an unusable folder, the newest
//          complete checkpoint by its manifest (a warning says why); no step folders at all:
//          start at step 1; step folders but none complete: refused;
//   PATH   that checkpoint folder.
// Throws with a message that says what to do.
std::optional<ResumePoint> find_resume_point(const GraphSpec& g, const std::string& out_dir);

// Load every saved state into the executor's state objects (by ref, e.g. "model.params") and
// restore the global RNG. Every state a checkpoint node of this graph saves must be in it.
void restore(Executor& ex, const GraphSpec& g, const ResumePoint& p);

}  // namespace flowrun
