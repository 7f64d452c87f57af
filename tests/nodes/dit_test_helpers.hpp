// Shared by the DiT-family tests (dit, lora, diffusion): a tiny DiT config and random weights.
#pragma once
#include <torch/torch.h>

#include "common/seed.hpp"
#include "models/dit/dit.hpp"

namespace flowrun::dit_test {

// patch 2, RGB, hidden 32, 2 heads, MLP 64, text 5 tokens of width 8 (T5: 3 tokens), no size/style
// conditioning, no learned sigma (dit_diffusers_test.cpp covers those).
inline dit::Config tiny(int64_t depth = 4, int64_t t5 = 0) {
  dit::Config c;
  c.patch = 2;
  c.in_channels = 3;
  c.hidden = 32;
  c.depth = depth;
  c.heads = 2;
  c.mlp_ratio = 2.0;
  c.text_dim = 8;
  c.t5_dim = t5;
  c.text_len = 5;
  c.text_len_t5 = 3;
  c.pooled_projection_dim = 16;
  c.use_style_cond_and_image_meta_size = false;
  c.learn_sigma = false;
  c.rope_base_grid = 0;  // integer patch positions, as these tests were written with
  return c;
}

// Every parameter N(0, 0.3^2) (the DiT init zeroes the output path, which would make output
// comparisons trivially equal).
inline void randomize(torch::nn::Module& m, uint64_t seed) {
  torch::NoGradGuard no_grad;
  at::Generator g = make_cpu_generator(seed);
  for (auto& p : m.parameters()) p.copy_(torch::randn(p.sizes(), g) * 0.3);
}

}  // namespace flowrun::dit_test
