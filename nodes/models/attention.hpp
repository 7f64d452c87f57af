// Fused attention on a GPU: softmax(q kᵀ · scale + bias) v with torch's
// scaled_dot_product_attention (flash / memory-efficient / cuDNN kernels, chosen by torch by
// shape and dtype), for every model's attention (gpt, dit, bert, t5, vae).
//
// Each model keeps its own attention written out for the CPU (and any libtorch before 2.0,
// which has no public SDPA): those paths are the reference its tests check against HF and
// diffusers transcriptions, and they are unchanged. A model calls
//
//   if (fused_attention_available(q)) return fused_attention(q, k, v, bias, causal, scale, p);
//
// first. q, k, v: [B, H, L, D] (k, v may have another L); bias: additive, broadcastable to
// [B, H, Lq, Lk], or undefined. No dropout: SDPA would draw it from the global generator, not
// the step's (models/dropout.hpp), so a model with attention dropout in training keeps its
// own path.
#pragma once
#include <torch/torch.h>
#include <torch/version.h>

namespace flowrun {

#if TORCH_VERSION_MAJOR >= 2
constexpr bool kHasFusedAttention = true;
#else
constexpr bool kHasFusedAttention = false;
#endif

inline bool fused_attention_available(const torch::Tensor& q) { return kHasFusedAttention && q.is_cuda(); }

inline torch::Tensor fused_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const torch::Tensor& bias, bool causal, double scale) {
#if TORCH_VERSION_MAJOR >= 2
  c10::optional<at::Tensor> mask;
  if (bias.defined()) mask = bias.to(q.scalar_type());
  return at::scaled_dot_product_attention(q, k, v, mask, /*dropout_p=*/0.0, causal, scale);
#else
  (void)q, (void)k, (void)v, (void)bias, (void)causal, (void)scale;
  throw std::logic_error("fused_attention: this libtorch has no scaled_dot_product_attention (check "
                         "fused_attention_available first)");
#endif
}

}  // namespace flowrun
