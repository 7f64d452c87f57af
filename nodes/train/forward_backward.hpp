// The computation behind the forward_backward node, usable on its own (tests, benches).
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

#include "common/grads.hpp"
#include "common/tensor_map.hpp"
#include "models/model_state.hpp"

namespace flowrun {

// An objective: the mean loss of the model on a (micro-)batch, with autograd attached.
// Adding one is a function and a line in objectives() (forward_backward.cpp) plus its name
// in schemas/forward_backward.yaml.
using Objective = torch::Tensor (*)(ModelState& model, const TensorMap& batch);
const Objective* find_objective(const std::string& name);

// Split a batch along dim 0 into n micro-batches (sizes differ by at most one). Every tensor
// with dim >= 1 must share its first dimension; 0-d tensors are given to every part.
std::vector<TensorMap> split_batch(const TensorMap& batch, int64_t n);
int64_t batch_rows(const TensorMap& batch);

struct FwdBwdResult {
  torch::Tensor loss;  // 0-d, detached: the mean loss over the batch
  Grads grads;         // aliases of the trainable parameters' .grad() (common/grads.hpp)
};

// Set the trainable parameters' grads to undefined, then for each of `accumulate` micro-batches
// run forward + backward of loss * rows/total, so the grads equal those of the whole batch's
// mean loss. Writes only .grad(), never parameter data.
FwdBwdResult forward_backward(ModelState& model, const TensorMap& batch, Objective objective, int64_t accumulate);

}  // namespace flowrun
