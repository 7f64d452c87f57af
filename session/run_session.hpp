// One run of a checked graph, as `flowrun run` does it, in the order it happens. The CLI parses
// the command line and loads the file; the session does the rest, in three calls:
//
//   RunSession s(loaded ? &g : nullptr);   // g: a checked graph (load_graph), or none if it failed
//   if (auto end = s.start()) return *end; // join the job and agree on the graph with every rank;
//                                          // threads, device, OUT_DIR and its lock, the trace and
//                                          // profile paths, the resume point, the logs
//   return s.close(s.run());               // stop signals, executor (restore, rank sync, progress);
//                                          // then the profile and the trace
//
// Every phase logs why it fails and gives the process exit code: 2 for what must be fixed before
// anything runs (a setting, a lock, a checkpoint that cannot be resumed), 1 for a failure while
// running (a node's error, an unwritable trace), 128 + N after stop signal N (Ctrl-C: 130,
// SIGTERM: 143, SIGUSR1: 138), 0 otherwise, including a run with nothing left to do.
//
// Its layer: above the nodes (it resumes through state/, syncs ranks through comm/, places tensors
// through common/), below the CLI. Torch-free interface.
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "node.hpp"

namespace flowrun {

struct GraphSpec;
class Executor;

class RunSession {
 public:
  // `g` outlives the session; nullptr: this rank's file did not load (under mpirun the other
  // ranks learn it in start(), instead of waiting for this one in their first collective).
  explicit RunSession(const GraphSpec* g);
  ~RunSession();
  RunSession(const RunSession&) = delete;
  RunSession& operator=(const RunSession&) = delete;

  // Everything before the first step. nullopt: ready to run; else the exit code (and the reason
  // logged) — 0 when the run is already at run.steps ("nothing to do").
  std::optional<int> start();
  // The steps: run.steps - first step + 1 of them, or fewer when a stop signal arrives. Only
  // after start() returned nullopt. Returns the exit code so far.
  int run();
  // Writes what the run collected (run.profile, run.trace); returns `code`, or 1 when that
  // fails after a run that succeeded.
  int close(int code);

  const RunInfo& info() const { return info_; }  // after start(): the resolved device, first step
  // Called in run() once every node is set up (and restored), before the first step: what the
  // nodes made, for a caller that reads it (flowrun plan: the model it profiles).
  std::function<void(Executor&)> on_setup;
  // A run for a command that trains nothing to keep (flowrun plan's profile): the first stop
  // signal exits at once with 128 + the signal, instead of stopping after the steps in flight.
  bool exit_on_signal = false;
  // A run of no step (flowrun ckpt export): the nodes set up, the checkpoint restored, on_setup
  // called, then run() returns 0; a checkpoint at or past run.steps is not "nothing to do".
  bool setup_only = false;

 private:
  struct Impl;
  const GraphSpec* g_;
  RunInfo info_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace flowrun
