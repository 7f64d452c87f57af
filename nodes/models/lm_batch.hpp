// A language model's batch (gpt, llama): "tokens", integer [B, T+1]; the model reads the inputs
// tokens[:, :-1] and the lm objective scores its logits against the targets tokens[:, 1:].
#pragma once
#include <torch/torch.h>

#include <stdexcept>
#include <string>

#include "common/tensor_map.hpp"

namespace flowrun {

// The inputs tokens[:, :-1] of `batch`; an error naming the model `kind` when it has no integer
// [B, T+1] "tokens" with T >= 1.
inline torch::Tensor lm_inputs(const TensorMap& batch, const std::string& kind) {
  auto it = batch.find("tokens");
  if (it == batch.end()) throw std::runtime_error(kind + ": the batch has no 'tokens'");
  const torch::Tensor& tokens = it->second;
  if (tokens.dim() != 2 || tokens.size(1) < 2 || !at::isIntegralType(tokens.scalar_type(), false))
    throw std::runtime_error(kind + ": batch 'tokens' must be integer [batch, T+1] with T >= 1, got " +
                             std::string(c10::toString(tokens.scalar_type())) + " " + shape_str(tokens));
  return tokens.narrow(1, 0, tokens.size(1) - 1);
}

}  // namespace flowrun
