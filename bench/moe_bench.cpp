// One mixture-of-experts block's forward and backward (models/moe.hpp), timed: what
// bench/moe_peers.py runs against transformers' Qwen3MoeSparseMoeBlock in alternating rounds.
//
//   moe_bench TOKENS DIM HIDDEN EXPERTS TOP_K STEPS WARMUP THREADS
//
// Random weights (N(0, 0.02); the router N(0, 1/sqrt(dim)), so that tokens spread) and inputs
// N(0, 1), fixed seed; each step: forward, the sum of the output times a fixed random gradient,
// backward into the input and every parameter. Prints "median_ms M" (over the steps after the
// warm-up) and the routing's balance.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <torch/torch.h>

#include "models/moe.hpp"

int main(int argc, char** argv) {
  if (argc != 9) {
    std::fprintf(stderr, "usage: moe_bench TOKENS DIM HIDDEN EXPERTS TOP_K STEPS WARMUP THREADS\n");
    return 2;
  }
  const int64_t tokens = std::atoll(argv[1]), dim = std::atoll(argv[2]), hidden = std::atoll(argv[3]),
                experts = std::atoll(argv[4]), top_k = std::atoll(argv[5]);
  const int steps = std::atoi(argv[6]), warmup = std::atoi(argv[7]);
  torch::set_num_threads(std::atoi(argv[8]));
  torch::manual_seed(0);
  flowrun::moe::Moe block(flowrun::moe::Options{dim, hidden, experts, top_k, true});
  {
    torch::NoGradGuard no_grad;
    (*block->gate)["weight"].normal_(0, 1.0 / std::sqrt(static_cast<double>(dim)));
    (*block->experts)["gate_up_proj"].normal_(0, 0.02);
    (*block->experts)["down_proj"].normal_(0, 0.02);
  }
  const torch::Tensor x0 = torch::randn({tokens, dim}), dy = torch::randn({tokens, dim});
  std::vector<double> ms;
  flowrun::moe::Routing routing;
  for (int s = 0; s < warmup + steps; ++s) {
    const torch::Tensor x = x0.clone().requires_grad_();
    for (auto& p : block->parameters()) p.mutable_grad() = torch::Tensor();
    const auto t0 = std::chrono::steady_clock::now();
    const torch::Tensor y = block->forward(x, &routing);
    (y * dy).sum().backward();
    const auto t1 = std::chrono::steady_clock::now();
    if (s >= warmup) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  const auto m = flowrun::moe::load_metrics(routing.counts.unsqueeze(0), {0});
  std::printf("median_ms %.3f\nbalance %.3f\n", ms[ms.size() / 2], m[0].second);
  return 0;
}
