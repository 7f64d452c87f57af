// LoRA (low-rank adapters, Hu et al. 2021) for any model built from lora::Linear layers, laid
// out like Hugging Face PEFT so that adapters export to / load from PEFT's files.
//
// lora::Linear is a drop-in torch::nn::Linear (weight [out, in], bias [out]; same parameter
// names, y = x W^T + b). apply_lora() gives the Linear layers whose module name matches a target
// an adapter: two more parameters under the layer,
//
//   <path>.lora_A.weight [rank, in]    PEFT's init: kaiming-uniform(a = sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in))
//   <path>.lora_B.weight [out, rank]   zeros (so the adapted model starts equal to the base)
//
// and the layer computes base(x) + B(A(dropout(x))) * alpha / rank. The base layer's own names
// do not change (PEFT renames them to .base_layer.*; we do not), so a base model's state dict —
// a diffusers file, or the model.params.safetensors a checkpoint node wrote for the base run —
// loads into the adapted model by name. Every parameter of the model that is not an adapter is
// frozen (requires_grad false): only lora_A / lora_B train.
//
// Targets match module names like PEFT's target_modules list: a module named N matches target T
// when N == T or N ends with "." + T ("to_q" matches blocks.3.attn1.to_q; "attn1.to_q" only the
// self-attention's; "to_out.0" the attention output projections).
//
// Tensor parallel (parallel/tensor_parallel.hpp): a layer the model splits (split() below)
// holds its part of W — its outputs' rows (column-parallel) or its inputs' columns
// (row-parallel) — and its adapter splits with it, so that B·A is this rank's part of the whole
// delta: with the outputs B's rows (A whole on every rank, its gradient summed over the group),
// with the inputs A's columns (B whole, its gradient summed). A is drawn whole and cut, the
// dropout mask of a split input cut from the whole input's, so adapters train alike at any tp;
// exports hold whole tensors, checkpoints each rank's parts placed in them (adapter_tp_split).
//
// PEFT files (export_peft / load_peft): DIR/adapter_model.safetensors holds
// "base_model.model.<path>.lora_A.weight" / ".lora_B.weight" for every adapted layer;
// DIR/adapter_config.json {"peft_type": "LORA", "r", "lora_alpha", "target_modules",
// "lora_dropout", "bias": "none", "base_model_name_or_path", "task_type": null, ...}.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "models/model_state.hpp"
#include "parallel/tensor_parallel.hpp"

namespace flowrun::lora {

// Which dimension of a layer tensor parallel splits: none, its outputs (column-parallel), or its
// inputs (row-parallel).
enum class TpRole { whole, outputs, inputs };

struct Config {
  int64_t rank = 8;
  double alpha = 8.0;                // scale = alpha / rank
  std::vector<std::string> targets;  // module-name suffixes (PEFT target_modules)
  double dropout = 0.0;              // on the adapter's input, inside forward_backward only
  void check() const;                // rank >= 1, targets not empty, dropout in [0, 1)
};

// One parameter `weight` (the adapter's A or B matrix), allocated but not initialised.
class FactorImpl : public torch::nn::Cloneable<FactorImpl> {
 public:
  FactorImpl(int64_t rows, int64_t cols) : rows_(rows), cols_(cols) { reset(); }
  void reset() override { weight = register_parameter("weight", torch::empty({rows_, cols_})); }
  torch::Tensor weight;

 private:
  int64_t rows_, cols_;
};
TORCH_MODULE(Factor);

// torch::nn::Linear's parameters and math, plus an optional adapter. reset() only allocates
// (the model's init or a load fills the values), so clone() draws no random numbers.
// fan_in_fan_out: Hugging Face's Conv1D layout instead (GPT-2): weight [in, out], y = x W + b;
// the adapter's A and B keep their shapes ([rank, in], [out, rank]), as PEFT's for a Conv1D
// (its adapter_config says fan_in_fan_out: true).
class LinearImpl : public torch::nn::Cloneable<LinearImpl> {
 public:
  LinearImpl(int64_t in, int64_t out, bool bias = true, bool fan_in_fan_out = false)
      : in_(in), out_(out), has_bias_(bias), fan_in_fan_out_(fan_in_fan_out) {
    reset();
  }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);
  // x W (+ the adapter's term) without the bias: a row-parallel layer's partial product, which
  // the tensor-parallel ranks sum before the bias is added once (layers::row_parallel).
  torch::Tensor forward_without_bias(const torch::Tensor& x);

  // Give the layer an adapter (lora_A, lora_B registered, uninitialised); `target` is the
  // target that matched it (exported as target_modules).
  void add_adapter(int64_t rank, double alpha, double dropout, const std::string& target);
  // Fold B·A·scale into weight and drop the adapter.
  void merge_adapter();
  bool has_adapter() const { return rank_ > 0; }
  int64_t rank() const { return rank_; }
  double alpha() const { return alpha_; }
  double dropout() const { return dropout_; }
  double scale() const { return rank_ > 0 ? alpha_ / static_cast<double>(rank_) : 0.0; }
  const std::string& target() const { return target_; }
  int64_t in_features() const { return in_; }   // this rank's part under tp
  int64_t out_features() const { return out_; }
  // Under tp (set by the model that splits the layer, before any adapter): the group and which
  // dimension it splits; in_features() / out_features() are then the part's.
  void set_tp(std::shared_ptr<parallel::Group> tp, TpRole role);
  // The whole layer's input width (in_features() times the group's size when the inputs are split).
  int64_t whole_in_features() const;
  // This rank's columns (last dimension) of `whole`, a tensor over the whole layer's inputs:
  // `whole` itself unless the inputs are split.
  torch::Tensor inputs_part(const torch::Tensor& whole) const;
  bool fan_in_fan_out() const { return fan_in_fan_out_; }

  torch::Tensor weight, bias;           // bias undefined without one
  Factor lora_A{nullptr}, lora_B{nullptr};  // null without an adapter

 private:
  torch::Tensor product(const torch::Tensor& x, const torch::Tensor& bias);
  int64_t in_, out_;
  bool has_bias_, fan_in_fan_out_;
  int64_t rank_ = 0;
  double alpha_ = 0.0, dropout_ = 0.0;
  std::string target_;
  std::shared_ptr<parallel::Group> tp_;  // null or a group of one: whole
  TpRole tp_role_ = TpRole::whole;
};
TORCH_MODULE(Linear);

// `layer` split over `tp` as `role` says (LinearImpl::set_tp), for a model's reset():
//   c_attn = register_module("c_attn", lora::split(conv1d(dim, 3 * width), tp, lora::TpRole::outputs));
inline Linear split(Linear layer, std::shared_ptr<parallel::Group> tp, TpRole role) {
  layer->set_tp(std::move(tp), role);
  return layer;
}

// How an adapter tensor of a split model is laid out over the tp group, from its base layer's
// split (`base`: the family's tp_split, asked for "<layer>.weight"; `fan_in_fan_out`: the
// family's weights are Conv1D [in, out]): a column-split layer's lora_B by rows (in the base's
// runs: GPT's q | k | v), a row-split layer's lora_A by columns, else whole. Families' tp_split
// call it for adapter names (is_adapter).
parallel::TpSplit adapter_tp_split(const std::string& name, const std::function<parallel::TpSplit(const std::string&)>& base,
                                   bool fan_in_fan_out);

// True for an adapter's parameter name ("h.0.attn.c_attn.lora_A.weight"): what a base model's
// file lacks (a loader's `optional`) and a model's init leaves to apply_lora.
inline bool is_adapter(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

// True when `name` matches target `t` (name == t or name ends with "." + t).
bool matches(const std::string& name, const std::string& target);

// Adapt every lora::Linear of `root` whose name matches a target: freeze all of root's
// parameters, then add adapters (A drawn from a generator seeded by `seed`, B = 0), which stay
// trainable. Throws if a target matches no module, or matches a module that is not a
// lora::Linear, or a matched layer already has an adapter. Returns the adapted module names.
std::vector<std::string> apply_lora(torch::nn::Module& root, const Config& cfg, uint64_t seed);

// The adapted layers of a module, by name (module order).
std::vector<std::pair<std::string, LinearImpl*>> adapted_layers(torch::nn::Module& root);
bool has_lora(const ModelState& model);
// The Config of the adapters of a model (targets: the matched targets, in first-use order).
// Throws if the model has none, or if its adapters disagree on rank / alpha / dropout.
Config adapter_config(const ModelState& model);

// What export_peft writes, computed at once (CPU copies), so a checkpoint can write it later.
struct PeftFiles {
  std::map<std::string, torch::Tensor> tensors;  // "base_model.model.<path>.lora_A.weight", ...
  std::string config_json;                       // adapter_config.json's text
};
PeftFiles peft_files(const ModelState& model, const std::string& base_model = "");
// Write DIR/adapter_model.safetensors then DIR/adapter_config.json, each to a temporary name
// renamed into place (a crash never leaves half a file). Creates DIR.
void write_peft(const std::string& dir, const PeftFiles& files);
inline void export_peft(const ModelState& model, const std::string& dir, const std::string& base_model = "") {
  write_peft(dir, peft_files(model, base_model));
}
// The ModelState::exporter of models built from lora::Linear layers: with adapters, a writer of
// their PEFT files as they are now (copied); without, none.
ModelState::ExportWriter peft_export(const ModelState& model);

// Load DIR's PEFT adapters into the model (DIR may go through a checkpoint's `latest`). A model without adapters gets them first, from
// adapter_config.json (r, lora_alpha, target_modules, lora_dropout; base frozen); a model that
// has them must agree with the file on the adapted layers. Every adapter tensor must be in the
// file with its shape; problems (missing, unexpected, mis-shaped) are listed in one error.
void load_peft(ModelState& model, const std::string& dir, uint64_t seed = 0);

// Fold every adapter into its base weight (W += scale · B·A) and remove the adapters: the
// model computes the same function with its original parameter names only. Parameters keep
// their requires_grad flags (the base stays frozen).
void merge_lora(ModelState& model);

}  // namespace flowrun::lora
