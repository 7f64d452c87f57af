// Layers several model families share, so a fix lands once (the attention: attention.hpp).
// Parameters are named as torch names them ("weight", "bias"), under the family's module names,
// so HF, diffusers and big_vision checkpoints load by name as before.
//
//   ln_1 = register_module("ln_1", layers::LayerNorm(dim));                        // GPT-2's
//   norm = register_module("norm", layers::LayerNorm(dim, layers::fp32_norm()));   // diffusers' FP32LayerNorm
#pragma once
#include <torch/torch.h>

namespace flowrun::layers {

struct NormOptions {
  double eps = 1e-5;
  bool weight = true;  // a gain; false: no parameters at all (bias must be false too)
  bool bias = true;
  bool fp32 = false;   // computed in float32 and cast back (diffusers' FP32LayerNorm)
};
// eps 1e-6 in float32, affine or not: the DiT's (diffusers' FP32LayerNorm).
inline NormOptions fp32_norm(bool affine = true) { return {1e-6, affine, affine, true}; }

// LayerNorm over the last dim: weight [dim] (ones), bias [dim] (zeros), each where the options say.
class LayerNormImpl : public torch::nn::Cloneable<LayerNormImpl> {
 public:
  explicit LayerNormImpl(int64_t dim, NormOptions o = {}) : dim_(dim), o_(o) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight, bias;

 private:
  int64_t dim_;
  NormOptions o_;
};
TORCH_MODULE(LayerNorm);

}  // namespace flowrun::layers
