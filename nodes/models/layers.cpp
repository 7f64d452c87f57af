// Layers several model families share (layers.hpp).
#include "models/layers.hpp"

#include <stdexcept>
#include <vector>

#include "models/gelu_tanh.hpp"

namespace flowrun::layers {

void LayerNormImpl::reset() {
  if (o_.bias && !o_.weight) throw std::logic_error("layers::LayerNorm: a bias without a weight");
  if (o_.weight) weight = register_parameter("weight", torch::ones({dim_}));
  if (o_.bias) bias = register_parameter("bias", torch::zeros({dim_}));
}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& x) {
  torch::Tensor w = weight.defined() ? parallel::copy_to_tp(weight, o_.tp) : torch::Tensor();
  torch::Tensor b = bias.defined() ? parallel::copy_to_tp(bias, o_.tp) : torch::Tensor();
  if (!o_.fp32) return torch::layer_norm(x, {dim_}, w, b, o_.eps);
  if (w.defined()) w = w.to(torch::kFloat);
  if (b.defined()) b = b.to(torch::kFloat);
  return torch::layer_norm(x.to(torch::kFloat), {dim_}, w, b, o_.eps).to(x.scalar_type());
}

torch::Tensor RmsNormImpl::forward(const torch::Tensor& x) {
  torch::Tensor var = x.to(torch::kFloat).pow(2).mean(-1, true);
  torch::Tensor h = x * torch::rsqrt(var + eps_);
  if (weight.scalar_type() == torch::kHalf || weight.scalar_type() == torch::kBFloat16) h = h.to(weight.scalar_type());
  return parallel::copy_to_tp(weight, tp_) * h;
}

torch::Tensor activate(const torch::Tensor& x, Act act) {
  switch (act) {
    case Act::gelu: return torch::gelu(x);
    case Act::gelu_tanh: return gelu_tanh(x);
    case Act::relu: return torch::relu(x);
    case Act::silu: return torch::silu(x);
  }
  throw std::logic_error("layers::activate: unknown activation");
}

// ---- MLP: projections at dotted module paths

namespace {

std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (size_t dot; (dot = path.find('.', start)) != std::string::npos; start = dot + 1) parts.push_back(path.substr(start, dot - start));
  parts.push_back(path.substr(start));
  for (const auto& p : parts)
    if (p.empty()) throw std::logic_error("layers::Mlp: the module path '" + path + "' has an empty part");
  return parts;
}

// One level of a dotted path ("net" and "0" of diffusers' ff.net.0.proj): children only. Copies
// are made child by child (torch's Cloneable rebuilds children through reset(), which a level
// cannot: what it holds is its parent's to decide).
class LevelImpl : public torch::nn::Module {
 public:
  std::shared_ptr<torch::nn::Module> clone(const c10::optional<torch::Device>& device) const override {
    auto copy = std::make_shared<LevelImpl>();
    for (const auto& child : named_children()) copy->register_module(child.key(), child.value()->clone(device));
    return copy;
  }

 private:
  void clone_(torch::nn::Module& other, const c10::optional<torch::Device>& device) override {
    for (const auto& child : other.named_children()) replace_module(child.key(), child.value()->clone(device));
  }
};

std::shared_ptr<torch::nn::Module> child_of(torch::nn::Module& m, const std::string& name) {
  const auto children = m.named_children();
  const auto* child = children.find(name);
  return child ? *child : nullptr;
}

// Register `layer` at `path` under `root`, making the levels on the way.
void register_at(torch::nn::Module& root, const std::string& path, const lora::Linear& layer) {
  const std::vector<std::string> parts = split_path(path);
  torch::nn::Module* at = &root;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    std::shared_ptr<torch::nn::Module> next = child_of(*at, parts[i]);
    if (!next) next = at->register_module(parts[i], std::make_shared<LevelImpl>());
    at = next.get();
  }
  at->register_module(parts.back(), layer);
}

// The layer at `path`, by torch's own dotted module names.
lora::Linear find_at(torch::nn::Module& root, const std::string& path) {
  const auto modules = root.named_modules("", /*include_self=*/false);
  const auto* at = modules.find(path);
  if (!at) throw std::logic_error("layers::Mlp: no module at '" + path + "'");
  auto linear = std::dynamic_pointer_cast<lora::LinearImpl>(*at);
  if (!linear) throw std::logic_error("layers::Mlp: the module at '" + path + "' is not a lora::Linear");
  return lora::Linear(linear);
}

}  // namespace

int64_t tp_share(int64_t n, const std::shared_ptr<parallel::Group>& tp, const std::string& what) {
  const int64_t parts = tp ? tp->size() : 1;
  if (n % parts != 0)
    throw std::runtime_error(what + " " + std::to_string(n) + " does not split into " + std::to_string(parts) +
                             " tensor-parallel parts; choose run.parallel.tp dividing it");
  return n / parts;
}

torch::Tensor row_parallel(lora::LinearImpl& fc, const torch::Tensor& x, const std::shared_ptr<parallel::Group>& tp) {
  if (!tp || tp->size() == 1) return fc.forward(x);
  torch::Tensor y = parallel::reduce_from_tp(fc.forward_without_bias(x), tp);
  return fc.bias.defined() ? y + fc.bias : y;
}

void MlpImpl::reset() {
  if (o_.fc1.empty() || o_.fc2.empty()) throw std::logic_error("layers::Mlp: fc1 and fc2 need names");
  const int64_t hidden = tp_share(hidden_, o_.tp, "the MLP's hidden width");
  auto linear = [&](int64_t in, int64_t out, lora::TpRole role) {
    return lora::split(lora::Linear(in, out, o_.bias, o_.fan_in_fan_out), o_.tp, role);
  };
  register_at(*this, o_.fc1, linear(dim_, hidden, lora::TpRole::outputs));
  if (!o_.gate.empty()) register_at(*this, o_.gate, linear(dim_, hidden, lora::TpRole::outputs));
  register_at(*this, o_.fc2, linear(hidden, o_.out > 0 ? o_.out : dim_, lora::TpRole::inputs));
  bind();
}

void MlpImpl::bind() {
  fc1 = find_at(*this, o_.fc1);
  fc2 = find_at(*this, o_.fc2);
  gate = o_.gate.empty() ? lora::Linear(nullptr) : find_at(*this, o_.gate);
}

std::shared_ptr<torch::nn::Module> MlpImpl::clone(const c10::optional<torch::Device>& device) const {
  auto copy = std::dynamic_pointer_cast<MlpImpl>(Cloneable<MlpImpl>::clone(device));
  copy->bind();
  return copy;
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  const torch::Tensor in = parallel::copy_to_tp(x, o_.tp);  // its gradient summed over the group
  torch::Tensor h = activate(fc1(in), o_.act);
  if (gate) h = h * gate(in);
  return row_parallel(*fc2, h, o_.tp);
}

void PatchConvImpl::reset() {
  weight = register_parameter("weight", torch::empty({out_, in_, patch_, patch_}));
  bias = register_parameter("bias", torch::zeros({out_}));
}

}  // namespace flowrun::layers
