// The generator behind the synthetic_regression node, usable on its own (tests, benches).
#pragma once
#include <torch/torch.h>

#include <cstdint>

#include "common/tensor_map.hpp"

namespace flowrun {

// A fixed random "teacher" network y = tanh(x W1 + b1) W2 + b2 (weights drawn from `seed`)
// and inputs x ~ N(0, 1)^in_dim; y gets N(0, noise^2) added. The batch for (step, rank)
// depends only on (seed, step, rank), never on what was drawn before.
class SyntheticRegression {
 public:
  SyntheticRegression(int64_t in_dim, int64_t out_dim, int64_t hidden, uint64_t seed, double noise);
  // {"x": [batch, in_dim], "y": [batch, out_dim]}, float32 on the CPU.
  TensorMap batch(int64_t step, int64_t batch_size, int rank = 0) const;
  // The noise-free target for x.
  torch::Tensor teacher(const torch::Tensor& x) const;

 private:
  int64_t in_dim_, out_dim_;
  uint64_t seed_;
  double noise_;
  torch::Tensor w1_, b1_, w2_, b2_;
};

}  // namespace flowrun
