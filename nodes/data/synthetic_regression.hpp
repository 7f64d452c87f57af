// The generator behind the synthetic_regression node, usable on its own (tests, benches).
#pragma once
#include <torch/torch.h>

#include <cstdint>

#include "common/tensor_map.hpp"

namespace flowrun {

// A fixed random "teacher" network y = tanh(x W1 + b1) W2 + b2 (weights drawn from `seed`)
// and inputs x ~ N(0, 1)^in_dim; y gets N(0, noise^2) added.
//
// Sharding, as token_shards: step s has one global batch of world * batch_size rows, drawn
// from (seed, s) only, never from what was drawn before; rank r takes rows
// [r * batch_size, (r + 1) * batch_size). So 2 ranks with batch B/2 see exactly the rows one
// process with batch B sees (each rank draws the whole global batch and keeps its slice:
// cheap for synthetic data, and the only way to make the rows independent of the world).
class SyntheticRegression {
 public:
  SyntheticRegression(int64_t in_dim, int64_t out_dim, int64_t hidden, uint64_t seed, double noise);
  // Rank `rank`'s slice of step `step`: {"x": [batch_size, in_dim], "y": [batch_size, out_dim]},
  // float32 on the CPU (contiguous).
  TensorMap batch(int64_t step, int64_t batch_size, int rank = 0, int world = 1) const;
  // The noise-free target for x.
  torch::Tensor teacher(const torch::Tensor& x) const;

 private:
  int64_t in_dim_, out_dim_;
  uint64_t seed_;
  double noise_;
  torch::Tensor w1_, b1_, w2_, b2_;
};

}  // namespace flowrun
