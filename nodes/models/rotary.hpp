// Rotary position embeddings (RoPE, Su et al. 2021) as Hugging Face transformers computes them for
// the decoder-only families (Llama, Qwen, Mistral: modeling_rope_utils.py and LlamaRotaryEmbedding):
// each head's channels in two halves, channel i of the first half turned with channel i of the
// second by the angle position x inv_freq[i] ("rotate_half"; not the interleaved pairs of the
// original paper or of HunyuanDiT's 2-D RoPE, dit.cpp).
//
//   const Rope rope(head_dim, theta, scaling);           // inv_freq once, float32, on the CPU
//   auto [cos, sin] = rope.cos_sin(T, q.device());       // [T, head_dim] each, float32
//   q = apply_rope(q, cos, sin);                         // q [B, H, T, head_dim]
//
// The frequencies: inv_freq[i] = 1 / theta^(2i / head_dim), in float32 as transformers computes
// them, then scaled as `scaling.type` says:
//   default   as they are
//   linear    all divided by `factor` (positions interpolated)
//   llama3    Llama 3.1's: wavelengths 2π/inv_freq above original_context / low_freq_factor divided
//             by `factor`, those below original_context / high_freq_factor kept, those between
//             blended smoothly (transformers' _compute_llama3_parameters)
// Other types (dynamic, yarn, longrope) are refused by name where a config asks for them.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>

namespace flowrun {

struct RopeScaling {
  std::string type = "default";  // default | linear | llama3
  double factor = 1.0;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;  // llama3
  int64_t original_context = 0;                          // llama3: original_max_position_embeddings
  // The types built here, for messages: "default, linear, llama3".
  static const char* types();
  // An error naming `what` for a type not built or a setting out of range.
  void check(const std::string& what) const;
  // "llama3 (factor 8, low_freq_factor 1, high_freq_factor 4, original_context 8192)", "none".
  std::string describe() const;
};

class Rope {
 public:
  Rope() = default;
  Rope(int64_t head_dim, double theta, const RopeScaling& scaling);
  // cos and sin of positions 0..T-1, [T, head_dim] (each frequency twice: the halves), float32 on
  // `device`.
  std::pair<torch::Tensor, torch::Tensor> cos_sin(int64_t T, const torch::Device& device) const;
  const torch::Tensor& inv_freq() const { return inv_freq_; }  // [head_dim / 2], float32, CPU

 private:
  torch::Tensor inv_freq_;
};

// x [B, H, T, D] turned by cos, sin [T, D]: x cos + rotate_half(x) sin, in x's dtype (cos and sin
// cast to it, as transformers does).
torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

}  // namespace flowrun
