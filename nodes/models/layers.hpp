// Layers several model families share, so a fix lands once (the attention: attention.hpp).
// Parameters are named as torch names them ("weight", "bias"), under module names the family
// gives (the MLP's projections by name or dotted path), so HF, diffusers, timm and big_vision
// checkpoints load by name as before.
//
//   ln_1 = register_module("ln_1", layers::LayerNorm(dim));                        // GPT-2's
//   norm = register_module("norm", layers::LayerNorm(dim, layers::fp32_norm()));   // diffusers' FP32LayerNorm
//   mlp = register_module("mlp", layers::Mlp(dim, 4 * dim, layers::MlpOptions{"c_fc", "c_proj", layers::Act::gelu_tanh}));
//   ff = register_module("ff", layers::Mlp(dim, inner, layers::MlpOptions{"net.0.proj", "net.2", layers::Act::gelu_tanh}));
//   patch_embed = register_module("patch_embed", layers::PatchEmbed(channels, width, patch));
#pragma once
#include <torch/torch.h>

#include <string>

#include "models/lora.hpp"
#include "parallel/tensor_parallel.hpp"

namespace flowrun::layers {

struct NormOptions {
  double eps = 1e-5;
  bool weight = true;  // a gain; false: no parameters at all (bias must be false too)
  bool bias = true;
  bool fp32 = false;   // computed in float32 and cast back (diffusers' FP32LayerNorm)
  // A norm whose input is each tp rank's part of a split tensor (the DiT's per-head q and k norms
  // over a rank's heads): its parameters, whole on every rank, get their gradients summed over
  // the group (parallel::copy_to_tp on them). Null: a norm of whole tensors.
  std::shared_ptr<parallel::Group> tp;
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

// A table of rows (a token or position embedding): one parameter `weight` [rows, dim]; reset()
// only allocates (the model's init or a load fills it).
class EmbeddingImpl : public torch::nn::Cloneable<EmbeddingImpl> {
 public:
  EmbeddingImpl(int64_t rows, int64_t dim) : rows_(rows), dim_(dim) { reset(); }
  void reset() override { weight = register_parameter("weight", torch::empty({rows_, dim_})); }
  torch::Tensor weight;

 private:
  int64_t rows_, dim_;
};
TORCH_MODULE(Embedding);

// RMS norm without a bias or a mean (T5's T5LayerNorm): weight * x / sqrt(mean(x^2) + eps), the
// mean in float32; with a bf16/fp16 weight the normalized x is cast to it first, as HF's does.
// `tp`, as NormOptions::tp: a norm over each tp rank's part of a split tensor (Qwen 3's per-head
// q and k norms over a rank's heads), its weight whole on every rank and its gradient summed.
class RmsNormImpl : public torch::nn::Cloneable<RmsNormImpl> {
 public:
  RmsNormImpl(int64_t dim, double eps, std::shared_ptr<parallel::Group> tp = nullptr)
      : dim_(dim), eps_(eps), tp_(std::move(tp)) { reset(); }
  void reset() override { weight = register_parameter("weight", torch::ones({dim_})); }
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;

 private:
  int64_t dim_;
  double eps_;
  std::shared_ptr<parallel::Group> tp_;
};
TORCH_MODULE(RmsNorm);

// The activations of the families' MLPs: exact GELU (erf: BERT, ViT/CapPa), GELU's tanh
// approximation (GPT-2's gelu_new, HunyuanDiT, T5 v1.1; fused on the CPU: gelu_tanh.hpp), ReLU
// (T5 v1.0), SiLU (diffusers' timestep and text projections).
enum class Act { gelu, gelu_tanh, relu, silu };
torch::Tensor activate(const torch::Tensor& x, Act act);

struct MlpOptions {
  std::string fc1 = "fc1";  // the input projection's module name; a dotted path nests (diffusers' "net.0.proj")
  std::string fc2 = "fc2";  // the output projection's
  Act act = Act::gelu;
  std::string gate;         // a gated MLP's second input projection (T5 v1.1's wi_1): fc2(act(fc1 x) * gate x)
  bool bias = true;
  bool fan_in_fan_out = false;  // Hugging Face's Conv1D layout, weight [in, out] (GPT-2)
  int64_t out = 0;              // output width; 0: the input's (dim)
  // Tensor parallel (parallel/tensor_parallel.hpp, Megatron's MLP): fc1 (and gate) split by
  // their outputs, fc2 by its inputs, so each rank holds hidden/tp of the hidden units and the
  // block costs one all-reduce each way. Null or a group of one: whole.
  std::shared_ptr<parallel::Group> tp;
};

// A row-parallel layer's output: this rank's partial product summed over the tp group, then the
// bias once (fc(x) itself without a group or with a group of one).
torch::Tensor row_parallel(lora::LinearImpl& fc, const torch::Tensor& x, const std::shared_ptr<parallel::Group>& tp);
// `n` over the tp group's size: what each rank holds of a split width; an error naming `what`
// when it does not divide.
int64_t tp_share(int64_t n, const std::shared_ptr<parallel::Group>& tp, const std::string& what);

// The transformer MLP, fc2(act(fc1(x))) (or gated), its projections lora::Linear, so LoRA targets
// them by name ("mlp.c_fc", "ff.net.0.proj", "fc1"). Parameters: FC1.weight [hidden, dim] (Conv1D:
// [dim, hidden]), FC1.bias [hidden], FC2.weight [out, hidden], FC2.bias [out], GATE like FC1.
// Dropout, where a family has it, is the block's (after fc2).
class MlpImpl : public torch::nn::Cloneable<MlpImpl> {
 public:
  MlpImpl(int64_t dim, int64_t hidden, MlpOptions o = {}) : dim_(dim), hidden_(hidden), o_(std::move(o)) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);
  // Cloneable's, then fc1/fc2/gate pointed at the copy's layers (a dotted path's levels are
  // copied as a whole, so the layers reset() made are not the ones the copy keeps).
  std::shared_ptr<torch::nn::Module> clone(const c10::optional<torch::Device>& device = c10::nullopt) const override;
  lora::Linear fc1{nullptr}, fc2{nullptr}, gate{nullptr};  // gate null unless gated

 private:
  void bind();
  int64_t dim_, hidden_;
  MlpOptions o_;
};
TORCH_MODULE(Mlp);

// A conv with kernel = stride = patch (ViT's and the DiT's patch projection): weight
// [out, in, patch, patch], bias [out]; reset() only allocates (the model's init or a load fills it).
class PatchConvImpl : public torch::nn::Cloneable<PatchConvImpl> {
 public:
  PatchConvImpl(int64_t in, int64_t out, int64_t patch) : in_(in), out_(out), patch_(patch) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x) { return torch::conv2d(x, weight, bias, {patch_, patch_}); }
  torch::Tensor weight, bias;

 private:
  int64_t in_, out_, patch_;
};
TORCH_MODULE(PatchConv);

// The patch embedding (timm's and diffusers' PatchEmbed): `proj`, a PatchConv; images
// [B, C, H, W] (H, W multiples of patch) -> tokens [B, (H/p)(W/p), width], patches in row-major order.
class PatchEmbedImpl : public torch::nn::Cloneable<PatchEmbedImpl> {
 public:
  PatchEmbedImpl(int64_t channels, int64_t width, int64_t patch) : channels_(channels), width_(width), patch_(patch) {
    reset();
  }
  void reset() override { proj = register_module("proj", PatchConv(channels_, width_, patch_)); }
  torch::Tensor forward(const torch::Tensor& images) { return proj(images).flatten(2).transpose(1, 2); }
  PatchConv proj{nullptr};

 private:
  int64_t channels_, width_, patch_;
};
TORCH_MODULE(PatchEmbed);

}  // namespace flowrun::layers
