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
// the step's (models/dropout.hpp). So GPT writes its attention out itself only with attention
// dropout in training (gpt.cpp: a cached causal mask in one baddbmm, the dropout from the step's
// generator), and calls self_attention below otherwise.
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

// Self-attention from one fused projection, as GPT-2's c_attn makes it: qkv [B, L, 3*H*D] (or
// [B*L, 3*H*D]) whose columns are q | k | v, each with its H heads side by side -> [B, L, H*D].
// On a GPU: SDPA on strided views of qkv (no copy; backward's gradient of the split is one
// concatenation). On the CPU in float32 without a bias: one fused kernel (attention_cpu.cpp) that
// reads q, k and v where they are, softmaxes in cache, skips the products the causal mask makes
// zero, and writes the gradient of qkv in place. Elsewhere attention() on the heads.
torch::Tensor self_attention(const torch::Tensor& qkv, int64_t B, int64_t L, int64_t H, const AttentionOptions& o = {});

// The CPU kernel (attention_cpu.cpp): whether self_attention takes it for these inputs, and the
// kernel itself (qkv [B, L, 3*H*D] float32 -> [B, L, H*D]; scale as given, no default).
bool cpu_attention_kernel_applies(const torch::Tensor& qkv, const AttentionOptions& o);
torch::Tensor cpu_self_attention(const torch::Tensor& qkv, int64_t H, bool causal, double scale);

}  // namespace flowrun
