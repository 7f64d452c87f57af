// The MLP module (mlp.hpp).
#include "models/mlp.hpp"

#include <cmath>
#include <stdexcept>

#include "common/batch_keys.hpp"
#include "common/seed.hpp"

namespace flowrun::mlp {

namespace {

torch::nn::AnyModule activation(const std::string& name) {
  if (name == "relu") return torch::nn::AnyModule(torch::nn::ReLU());
  if (name == "gelu") return torch::nn::AnyModule(torch::nn::GELU());
  if (name == "tanh") return torch::nn::AnyModule(torch::nn::Tanh());
  throw std::invalid_argument("mlp: unknown activation '" + name + "' (relu, gelu or tanh)");
}

}  // namespace

double parameter_count(const Config& c) {
  const double in = static_cast<double>(c.in_dim), h = static_cast<double>(c.hidden), out = static_cast<double>(c.out_dim);
  if (c.layers == 0) return (in + 1) * out;
  return (in + 1) * h + static_cast<double>(c.layers - 1) * (h + 1) * h + (h + 1) * out;
}

std::shared_ptr<ModelState> make(const Config& c, uint64_t seed) {
  torch::nn::Sequential seq;
  int64_t d = c.in_dim;
  for (int64_t i = 0; i < c.layers; ++i) {
    seq->push_back(torch::nn::Linear(d, c.hidden));
    seq->push_back(activation(c.activation));
    d = c.hidden;
  }
  seq->push_back(torch::nn::Linear(d, c.out_dim));
  {
    torch::NoGradGuard no_grad;
    at::Generator g = make_cpu_generator(mix_seed({seed, kSeedTagInit}));
    for (const auto& child : seq->children()) {
      if (auto* lin = child->as<torch::nn::LinearImpl>()) {
        const double bound = 1.0 / std::sqrt(static_cast<double>(lin->weight.size(1)));  // fan_in
        lin->weight.uniform_(-bound, bound, g);
        if (lin->bias.defined()) lin->bias.uniform_(-bound, bound, g);
      }
    }
  }
  ModelState::ForwardFn fwd = [](torch::nn::Module& m, const TensorMap& batch) {
    auto it = batch.find(batch_key::features);
    if (it == batch.end()) throw std::runtime_error(std::string("mlp: the batch has no '") + batch_key::features + "'");
    auto* s = m.as<torch::nn::SequentialImpl>();
    if (!s) throw std::runtime_error("mlp: the model's module is not an nn::Sequential");
    return s->forward(it->second);
  };
  return std::make_shared<ModelState>(std::static_pointer_cast<torch::nn::Module>(seq.ptr()), fwd, "mlp");
}

}  // namespace flowrun::mlp
