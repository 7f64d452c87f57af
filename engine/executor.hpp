// Executor: runs a checked GraphSpec as a tbb::flow::graph, keeping the semantics of the
// sequential program (file order = program order, repeated run.steps times):
//   - a value is produced once per step and read by later nodes of the same step;
//   - a state access waits for what the sequential program orders before it: a write for
//     every earlier read and write, a read for the last earlier write;
//   - serial nodes run one step at a time in step order; stateless nodes in parallel;
//   - periodic nodes exist only on their steps (accesses too);
//   - at most run.prefetch + 1 steps are in flight (a limiter_node), so value-only chains
//     (data, frozen encoders) run ahead of training by up to run.prefetch steps.
// See docs/executor.md for how the dependencies are derived.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

#include "node.hpp"
#include "spec.hpp"

namespace flowrun {

class Registry;
class Tracer;
class NodeError;
class DeviceStreams;

struct RunOptions {
  int prefetch = 2;
  int workers = 0;                          // executor threads; 0 = cores
  Tracer* tracer = nullptr;                 // optional
  const std::atomic<int>* stop = nullptr;   // > 0: start no new steps (a stop signal)
  // Instead of `stop` where several processes must stop at the same step: called before step s
  // is admitted, once per step in step order; true = admit no more. (A run session's ranks agree on
  // it with one small all-reduce per step: session/run_session.cpp.)
  std::function<bool(int64_t step)> stop_before;
  std::function<void(int64_t step)> on_step_done;  // called in step order
  // Called once, on the failing node's thread, as soon as the first node fails (before the
  // steps in flight drain). A run session ends a multi-process job from here (comm::abort_job).
  std::function<void(const NodeError&)> on_error;
  // Device streams (device_streams.hpp): nodes enqueue work on their graph stream and the
  // executor orders streams with events. nullptr (CPU): nodes run synchronously.
  DeviceStreams* streams = nullptr;
  // Run the nodes of compute types (schema `compute: true`) on the thread that calls run()
  // instead of the workers: tensor math from one thread, so the math library keeps one thread
  // pool (run.compute_thread). The other nodes (readers, comm, checkpoints) stay on the workers.
  bool compute_thread = false;
  // With compute_thread: called once on each worker thread before the first node it runs
  // (a run session limits the math library to one thread there: workers run I/O, not math).
  std::function<void()> on_worker_thread;
};

struct RunStats {
  int64_t first_step = 0, last_step_done = 0;
  double seconds = 0;
  bool stopped = false;  // by `stop` or `stop_before`
};

// An exception in a node, with where it happened.
class NodeError : public std::runtime_error {
 public:
  NodeError(std::string node, std::string type, int64_t step, const std::string& what);
  std::string node, type;
  int64_t step;
};

// The run settings of a checked graph (its `run:` section): steps 1..run.steps, seed,
// log_every, out_dir; and the executor options it sets (prefetch, workers).
RunInfo run_info(const GraphSpec& g);
RunOptions run_options(const GraphSpec& g);

class Executor {
 public:
  // Creates every node and runs setup() in file order. `info.first_step/last_step` bound the run.
  Executor(const GraphSpec& g, const Registry& reg, RunInfo info);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Runs steps info.first_step..info.last_step; then every node's finish(). Throws NodeError.
  RunStats run(const RunOptions& opt);

  Node& node(const std::string& name);
  // The object behind NODE's owned state output PORT (for tests, checkpoints).
  Value& state(const std::string& node, const std::string& port);
  const RunInfo& info() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace flowrun
