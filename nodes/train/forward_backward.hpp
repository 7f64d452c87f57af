// The computation behind the forward_backward node, usable on its own (tests, benches).
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/grads.hpp"
#include "common/tensor_map.hpp"
#include "models/model_state.hpp"
#include "train/grad_buffer.hpp"
#include "train/grad_hooks.hpp"
#include "train/objective.hpp"
#include "train/precision.hpp"

namespace flowrun {

// Split a batch along dim 0 into n micro-batches (sizes differ by at most one). Every tensor
// with dim >= 1 must share its first dimension; 0-d tensors are given to every part.
std::vector<TensorMap> split_batch(const TensorMap& batch, int64_t n);
int64_t batch_rows(const TensorMap& batch);

// forward_backward's `profile` state (schemas/forward_backward.yaml): with time_blocks, what its
// first step estimated of one micro-batch: its rows, and the model's activations without
// recomputing (plain) and recomputing every block. What `flowrun plan` reads after its profile
// run (the block times are in the trace). rows 0: not recorded.
struct StepProfile {
  int64_t rows = 0;
  ActivationEstimate plain, blocks;
};

struct FwdBwdResult {
  torch::Tensor loss;  // 0-d, detached: the mean loss over the batch
  // Aliases of the trainable parameters' .grad() (common/grads.hpp): with a buffer, its views;
  // undefined for a parameter that got no gradient (whose view stays zero).
  Grads grads;
};

struct FwdBwdOptions {
  int64_t accumulate = 1;
  // The objective (forward and loss) runs under this precision's autocast; backward does not.
  Precision precision = Precision::fp32;
  // Set: each micro-batch's forward runs in a TrainingScope (models/dropout.hpp: dropout on),
  // micro-batch i seeded by mix_seed({*dropout_seed, i}). Unset: no dropout.
  std::optional<uint64_t> dropout_seed;
  // With dropout_seed: the scopes' per-row seeds (TrainingScope::set_rows): the step's seed,
  // the same on every rank, and the global index of this batch's first row (rank x rows).
  uint64_t rows_seed = 0;
  int64_t first_row = 0;

  // Set: the grads end up in this buffer (train/grad_buffer.hpp), made for the model's trainable
  // parameters, each .grad() one of its views; how they get there is `fill`. The caller makes
  // sure nobody still holds it (GradBuffer::reusable()). Unset: fresh grad tensors each step
  // (autograd writes each parameter's gradient once, into a tensor of its own). The grads are
  // bit-identical every way.
  std::shared_ptr<GradBuffer> buffer;
  GradFill fill = GradFill::accumulate;
  // Set: on_ready(i, true) is called from inside the LAST micro-batch's backward the moment
  // trainable parameter i's gradient is final, and after that backward, on_ready(i, used) once
  // for each parameter not reported yet (used: it got a gradient in an earlier micro-batch).
  // So each parameter is reported exactly once, in the order its gradient became final. Calls
  // are serialized.
  std::function<void(int param, bool used)> on_ready;
  // Set (ZeRO-3's ParamUse): on_pass(k) before micro-batch k's forward, and on_grad(i) from inside
  // every micro-batch's backward as parameter i's gradient of that micro-batch is added (what
  // lets a sharded block go as soon as its backward is done, micro-batch after micro-batch).
  // Serialized with on_ready.
  std::function<void(int micro_batch)> on_pass;
  std::function<void(int param)> on_grad;
  // Hooks on the parameters' grad accumulators, made once and kept across steps by the caller
  // (the node). Unset while a buffer or on_ready needs them: made for this call only.
  std::shared_ptr<GradHooks> hooks;
};

// Before a step's first backward: the trainable parameters' grads undefined (fresh), or with
// options.buffer and GradFill::accumulate the buffer zeroed and attached (GradFill::copy: the
// buffer remembers the parameters it will settle into).
void start_grads(const FwdBwdOptions& options, std::vector<torch::Tensor>& params);

// Clear the trainable parameters' grads (undefined; with options.buffer and GradFill::accumulate:
// zero the buffer and attach it), check the batch has what the objective needs, then for each of `accumulate`
// micro-batches run forward + backward of
// loss * rows/total, so the grads equal those of the whole batch's mean loss. Writes only
// .grad() (and the buffer), never parameter data.
FwdBwdResult forward_backward(ModelState& model, const TensorMap& batch, const Objective& objective,
                              const FwdBwdOptions& options);
inline FwdBwdResult forward_backward(ModelState& model, const TensorMap& batch, const Objective& objective,
                                     int64_t accumulate) {
  FwdBwdOptions o;
  o.accumulate = accumulate;
  return forward_backward(model, batch, objective, o);
}

}  // namespace flowrun
