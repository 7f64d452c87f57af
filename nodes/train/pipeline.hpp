// forward_backward under pipeline parallel (run.parallel.pp > 1; docs/parallel.md "Pipeline
// parallel"): the step's batch cut into micro-batches that flow through the model's chunks, each
// rank running its chunks' operations in the order its schedule says (parallel/pipeline_schedule.hpp:
// one rule for every schedule, the one `flowrun explain` prints).
//
//   F(k, m)  chunk k's forward of micro-batch m, inside the objective's loss on every stage (a
//            StageCall, models/stages.hpp): chunk k - 1's outputs received from the previous stage
//            as leaves that need a gradient (chunk 0: the model's inputs as the objective makes
//            them), the outputs sent on to the next stage; the last chunk's ends in the loss.
//   B(k, m)  backward from the gradient of k's outputs (received from the next stage; the last
//            chunk: its loss x the micro-batch's share of the rows), the inputs' gradients sent back.
//   W(k, m)  zero_bubble: the weight gradients B(k, m) left (models/linear.hpp's DeferredWeightGrads).
//
// Messages go on this node's own channel over its pp ranks (parallel/tensor_messages.hpp), sends
// without waiting (the communication thread), so compute runs while they travel. After the last
// operation: the tied parameters' gradients summed between the first and the last stage, and the
// loss (the last stage's) given to every stage. The gradients equal one process's with
// `accumulate: M` (the same micro-batches, the same draws) up to the order of the sums, and with
// `accumulate: 1` too when the objective draws nothing (the lm loss).
#pragma once
#include <chrono>
#include <map>
#include <memory>

#include "parallel/collectives.hpp"
#include "parallel/pipeline_schedule.hpp"
#include "train/forward_backward.hpp"

namespace flowrun {

struct PipelineRun {
  parallel::pipeline::Schedule schedule;
  std::shared_ptr<parallel::Group> group;  // the node's channel over its pp ranks (rank = pp coordinate)
  int stage = 0;                           // this rank's pp coordinate
  // How many messages each peer (pp coordinate) sends this rank in a step, from the schedule.
  std::map<int, int> from_peers;
  // The schedule, this rank's coordinate and its channel; from_peers counted.
  PipelineRun(parallel::pipeline::Schedule s, std::shared_ptr<parallel::Group> g, int stage);
  // Per operation of this rank's program, when it started and ended in the last step: the
  // measured timeline (forward_backward marks it in the trace, run.trace).
  struct Timed {
    parallel::pipeline::Op op;
    std::chrono::steady_clock::time_point start, end;
  };
  std::vector<Timed> last_step;
};

// forward_backward (forward_backward.hpp) with the model's chunks this rank holds
// (ModelState::stages), as `run` schedules them. `options`: accumulate is the schedule's
// micro-batch count; buffer, fill and on_ready as forward_backward (on_ready for every parameter
// after the last operation); on_pass, on_grad and hooks unused.
FwdBwdResult pipeline_forward_backward(ModelState& model, const TensorMap& batch, const Objective& objective,
                                       const FwdBwdOptions& options, PipelineRun& run);

}  // namespace flowrun
