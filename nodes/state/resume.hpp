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

// run.resume: "" = start fresh; "auto" = the `latest` checkpoint of the graph's checkpoint node
// if there is one (else start fresh); otherwise a checkpoint folder path. Throws with a clear
// message when a named checkpoint is missing or incomplete.
std::optional<ResumePoint> find_resume_point(const GraphSpec& g, const std::string& out_dir);

// Load every saved state into the executor's state objects (by ref, e.g. "model.params") and
// restore the global RNG. Every state a checkpoint node of this graph saves must be in it.
void restore(Executor& ex, const GraphSpec& g, const ResumePoint& p);

}  // namespace flowrun
