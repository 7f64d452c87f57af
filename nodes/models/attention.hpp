// The attention every model runs: softmax(q kᵀ · scale + bias) v over heads, one function for
// the six families (gpt, dit, bert, t5, vae, cappa), so a speed fix lands once.
//
//   torch::Tensor y = attention(q, k, v, {mask});   // q [B, H, Lq, D], k, v [B, H, Lk, D], an additive
//                                                   // mask -> [B, Lq, H*D], the heads side by side
//
// On a GPU it is torch's scaled_dot_product_attention (flash / memory-efficient
// / cuDNN kernels, chosen by torch by shape and dtype); elsewhere it is written out, the query rows
// in chunks so that no more than 2^25 scores exist at once (a 1024-px VAE's 16384 positions need
// no 16384² matrix). The written-out path is the reference the families' tests check against the
// HF and diffusers transcriptions. No dropout: SDPA would draw it from the global generator, not
// the step's (models/dropout.hpp). So GPT keeps its own CPU path (gpt.cpp: a cached causal mask in
// one baddbmm, attention dropout from the step's generator) and calls this one on a GPU when no
// attention dropout is on.
#pragma once
#include <torch/torch.h>

namespace flowrun {

inline bool fused_attention_available(const torch::Tensor& q) { return q.is_cuda(); }

inline torch::Tensor fused_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const torch::Tensor& bias, bool causal, double scale) {
  c10::optional<at::Tensor> mask;
  if (bias.defined()) mask = bias.to(q.scalar_type());
  return at::scaled_dot_product_attention(q, k, v, mask, /*dropout_p=*/0.0, causal, scale);
}

struct AttentionOptions {
  torch::Tensor bias;         // additive, broadcastable to [B, H, Lq, Lk]; undefined: none
  double scale = 0.0;         // 0: 1/sqrt(D); T5 has none (1)
  bool causal = false;        // query i sees keys 0..i
  bool fp32_softmax = false;  // written-out path: softmax in float32, cast back (T5; diffusers' upcast_softmax)
};

// q [B, H, Lq, D], k and v [B, H, Lk, D] -> [B, Lq, H*D].
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const AttentionOptions& o = {});

}  // namespace flowrun
