// A multi-layer perceptron as a libtorch module: `layers` hidden Linear layers of width
// `hidden` with an activation after each, then a Linear to `out_dim`; torch::nn::Sequential's
// layout, so names match PyTorch's nn.Sequential (0.weight, 0.bias, 2.weight, ...). The node
// type mlp: mlp_node.cpp. Test: tests/nodes/mlp_test.cpp.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>

#include "models/model_state.hpp"

namespace flowrun::mlp {

struct Config {
  int64_t in_dim = 1, hidden = 64, layers = 2, out_dim = 1;
  std::string activation = "relu";  // relu | gelu | tanh
};

// How many parameters the model has (weights and biases), before allocating any.
double parameter_count(const Config& c);

// The model, initialised as PyTorch's default Linear init (weight and bias ~ U(-1/sqrt(fan_in),
// 1/sqrt(fan_in))) from a generator of its own seeded by `seed` alone, on the CPU, as a state
// whose forward reads the batch's "x".
std::shared_ptr<ModelState> make(const Config& c, uint64_t seed);

}  // namespace flowrun::mlp
