// TensorMap: a batch. Data nodes output one per step as a Value holding a TensorMap
// (port type `batch`); keys are documented by each data node ("x", "y", "tokens", ...).
// Tensors of one batch share their first dimension (the batch dimension), which is what
// forward_backward splits into micro-batches.
#pragma once
#include <torch/torch.h>

#include <map>
#include <string>

namespace flowrun {

using TensorMap = std::map<std::string, torch::Tensor>;

}  // namespace flowrun
