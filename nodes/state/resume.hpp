// Resuming a run from a checkpoint (run.resume): which checkpoint, and loading it into the
// executor's state objects. Torch-free interface: the run session (session/) includes it.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace flowrun {

class Executor;
struct GraphSpec;
namespace comm {
class Channel;
}

struct ResumePoint {
  std::string folder;  // the checkpoint folder (with manifest.json)
  int64_t step = 0;    // the run continues at step + 1
};

// run.resume (schemas/graph.yaml):
//   ""     start at step 1; refused when a checkpoint node's folder already holds step folders
//          (they would be replaced);
//   never  start at step 1 anyway (the checkpoint node moves the old folders aside once the new
//          run's first checkpoint is complete: a run that fails before has lost nothing);
//   auto   the newest complete checkpoint (by its manifest, its files all there at their sizes)
//          of any of the graph's checkpoint nodes that holds every state the graph saves and is
//          not in `damaged` (folder -> why: what verify_checkpoint found): normally what
//          `latest` names; when `latest` is missing, empty, unusable, damaged or names an older
//          one, a warning says so; no step folders at all: start at step 1; step folders but none
//          usable: refused;
//   PATH   that checkpoint folder; refused when this run's folders hold later complete
//          checkpoints whose files verify (resuming would write those steps again, over them);
//          later ones that are damaged are named in a warning.
// Throws with a message that says what to do.
std::optional<ResumePoint> find_resume_point(const GraphSpec& g, const std::string& out_dir,
                                             const std::map<std::string, std::string>& damaged = {});

// A checkpoint's files read whole and their CRC32C compared with its manifest's, shared out over
// the ranks of `channel` (rank r reads files r, r + world, ...; null: this process reads them all).
// Collective: every rank gets the same answer, "" or what is damaged, naming the files. A
// manifest of version 1 (no checksums) checks nothing.
std::string verify_checkpoint(const std::string& folder, comm::Channel* channel);

// Load every saved state into the executor's state objects (by ref, e.g. "model.params") and
// restore the global RNG. Every state a checkpoint node of this graph saves must be in it.
// Settings that differ from the checkpoint's run (its manifest's config) are logged as a warning.
void restore(Executor& ex, const GraphSpec& g, const ResumePoint& p);

// One side of a resume, the checkpoint's run or this one: its resolved config (YAML, as the
// checkpoint manifest keeps it) and its processes (0: not recorded, an older manifest).
struct RunRecord {
  std::string config;
  int world = 0;
};

// What differs between the checkpoint's run (`saved`) and this one (`now`), one line each:
//   - the mesh, when the processes, tp or pp differ: "processes 1 (dp 1 x pp 2 x tp 1); the
//     checkpoint's run had 2 (dp 1 x pp 1 x tp 2)";
//   - the global batch of each data source (`batch_keys`: the NODE.batch settings that are per
//     rank) when its batch or dp differs: "global batch (data): 16 x dp 1 = 16 a step; the
//     checkpoint's run had 16 x dp 2 = 32";
//   - every other setting that differs and was in effect in either run, "KEY.PATH: now (the
//     checkpoint's run had saved)". Not compared: run settings about how a process runs (steps,
//     resume, threads, trace, ...), the pipeline's (schedule, microbatches, ...) when neither run
//     had pp > 1.
std::vector<std::string> changed_settings(const RunRecord& saved, const RunRecord& now,
                                          const std::vector<std::string>& batch_keys = {});

// Before a run writes its logs in OUT_DIR (rank 0): at a fresh start (first_step 1) the earlier
// run's metrics.jsonl and tb/ move aside (metrics.previous-STAMP.jsonl, tb.previous-STAMP/), so
// the new curves are not drawn after the old ones; on resume at step k+1, metrics.jsonl keeps
// only the lines of steps <= k (the stopped run may have logged later steps, which this run
// logs again). A metrics.jsonl or tb that is a link is left alone. Returns what it did, for the
// log ("" if nothing).
std::string prepare_run_logs(const std::string& out_dir, int64_t first_step);

}  // namespace flowrun
