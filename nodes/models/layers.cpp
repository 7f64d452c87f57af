// Layers several model families share (layers.hpp).
#include "models/layers.hpp"

#include <stdexcept>

namespace flowrun::layers {

void LayerNormImpl::reset() {
  if (o_.bias && !o_.weight) throw std::logic_error("layers::LayerNorm: a bias without a weight");
  if (o_.weight) weight = register_parameter("weight", torch::ones({dim_}));
  if (o_.bias) bias = register_parameter("bias", torch::zeros({dim_}));
}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& x) {
  if (!o_.fp32) return torch::layer_norm(x, {dim_}, weight, bias, o_.eps);
  torch::Tensor w = weight.defined() ? weight.to(torch::kFloat) : torch::Tensor();
  torch::Tensor b = bias.defined() ? bias.to(torch::kFloat) : torch::Tensor();
  return torch::layer_norm(x.to(torch::kFloat), {dim_}, w, b, o_.eps).to(x.scalar_type());
}

}  // namespace flowrun::layers
