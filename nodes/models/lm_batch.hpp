// A language model's batch and token ids (gpt, llama): "tokens", integer [B, T+1]; the model reads the inputs
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

// A packed batch's (data/packed_shards.hpp) per-token positions and segments, int64 [B, T] each:
// the rotary positions restart at each document, attention stays within a segment. Undefined when
// the batch has neither (one sequence per row, positions 0..T-1).
struct LmPacking {
  torch::Tensor positions, segments;
  bool packed() const { return positions.defined(); }
};

// `batch`'s packing for the inputs [B, T]; an error naming the model `kind` when it has one of the
// two keys without the other or of another shape.
inline LmPacking lm_packing(const TensorMap& batch, const torch::Tensor& inputs, const std::string& kind) {
  const auto p = batch.find("positions"), s = batch.find("segments");
  if (p == batch.end() && s == batch.end()) return {};
  if (p == batch.end() || s == batch.end())
    throw std::runtime_error(kind + ": the batch has '" + std::string(p == batch.end() ? "segments" : "positions") +
                             "' without '" + std::string(p == batch.end() ? "positions" : "segments") + "' (a packed batch has both)");
  for (const torch::Tensor& t : {p->second, s->second})
    if (t.sizes() != inputs.sizes() || !at::isIntegralType(t.scalar_type(), false))
      throw std::runtime_error(kind + ": a packed batch's positions and segments must be integer " + shape_str(inputs) +
                               " like the inputs, got " + shape_str(t));
  return {p->second.to(torch::kLong), s->second.to(torch::kLong)};
}

// The rows lm_loss scores (int64 [M], indices into the B*T positions, "loss_rows"), when the batch
// has a loss mask: a model that reads them computes its head on those rows only and returns their
// logits [M, vocab] (the others' softmax never runs: the prompt of a chat costs no vocab-wide
// product); undefined: every row, logits [B, T, vocab].
inline torch::Tensor lm_loss_rows(const TensorMap& batch) {
  const auto it = batch.find("loss_rows");
  return it == batch.end() ? torch::Tensor() : it->second;
}

// Token ids [B, T] a language model of `context` positions and `vocab` tokens can read: an error
// naming the model `kind` otherwise (the ids' range checked on the CPU only: a clear message
// instead of index_select's, with no device sync).
inline void check_token_ids(const torch::Tensor& idx, int64_t context, int64_t vocab, const std::string& kind) {
  if (idx.dim() != 2) throw std::runtime_error(kind + ": token ids must be [batch, T], got " + shape_str(idx));
  if (idx.size(1) > context)
    throw std::runtime_error(kind + ": " + std::to_string(idx.size(1)) + " input tokens per row but the model's context is " +
                             std::to_string(context) + " positions; raise `context` or shorten the data's seq_len");
  if (idx.is_cpu() && idx.numel() > 0) {
    auto [lo, hi] = torch::aminmax(idx);
    if (lo.item<int64_t>() < 0 || hi.item<int64_t>() >= vocab)
      throw std::runtime_error(kind + ": token ids range over [" + std::to_string(lo.item<int64_t>()) + ", " +
                               std::to_string(hi.item<int64_t>()) + "] but the vocabulary has " + std::to_string(vocab) +
                               " tokens");
  }
}

}  // namespace flowrun
