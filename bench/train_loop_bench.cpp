// flowrun's graph against a hand-written libtorch training loop, same model code, same data,
// same optimizer, in one process, alternating rounds (median of 3). Two cases:
//   plain       the reader is fast: flowrun must cost nothing (target >= 0.97x the loop);
//   slow reader the reader sleeps `delay` ms per batch: prefetch must hide it behind the step
//               (target >= 1.3x the serial loop).
// Model: the GPT test config (2 layers, 128 wide, 4 heads, 64 tokens, batch 32, byte vocab) on
// the fortunes byte shards (scripts/data.sh). Usage:
//   ./build/bench/train_loop_bench [--steps 40] [--delay-ms 60] [--data data/text/fortunes_byte]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <thread>

#include "bench_graph.hpp"
#include "data/token_shards.hpp"
#include "models/gpt/gpt.hpp"
#include "registry.hpp"
#include "spec.hpp"
#include "train/forward_backward.hpp"
#include "train/losses.hpp"
#include "train/optimizer.hpp"

using namespace flowrun;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kLayers = 2, kDim = 128, kHeads = 4, kT = 64, kBatch = 32, kVocab = 256;
constexpr double kLr = 3e-3;
constexpr uint64_t kSeed = 1;

// The hand-written loop: what a user writes without flowrun.
double hand_loop(const std::string& data, int steps, int delay_ms) {
  TokenShardSampler sampler(TokenWindows(std::make_shared<IndexedDataset>(data + ".train"), kT), kBatch, kSeed);
  gpt::Config c;
  c.layers = kLayers, c.dim = kDim, c.heads = kHeads, c.vocab = kVocab, c.context = kT;
  gpt::Gpt m(c);
  gpt::init_weights(*m, kSeed);
  std::shared_ptr<ModelState> model = gpt::make_state(m);
  const LmLoss lm;
  OptimizerState st;
  OptimConfig cfg;  // adamw, as the graph
  auto t0 = Clock::now();
  for (int s = 1; s <= steps; ++s) {
    if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    TensorMap batch = sampler.batch(s, 0, 1);
    FwdBwdResult r = forward_backward(*model, batch, lm, 1);
    optimizer_update(st, model->named_parameters(true), r.grads, cfg, kLr);
  }
  return steps / std::chrono::duration<double>(Clock::now() - t0).count();
}

// The same work as a flowrun graph.
double graph_run(const std::string& data, int steps, int delay_ms, int prefetch) {
  std::ostringstream y;
  y << "flowrun: 1\nrun: { steps: " << steps << ", seed: " << kSeed << ", prefetch: " << prefetch
                      << ", progress: off }\nnodes:\n"
                      << "  data: { type: token_shards, with: { path: " << data << ", seq_len: " << kT << ", batch: " << kBatch
                      << ", delay_ms: " << delay_ms << " } }\n"
                      << "  model: { type: gpt, with: { layers: " << kLayers << ", dim: " << kDim << ", heads: " << kHeads
                      << ", vocab: " << kVocab << ", context: " << kT << " } }\n"
                      << "  loss: { type: lm_loss }\n"
                      << "  fb: { type: forward_backward, in: { batch: data.batch, objective: loss.objective, model: model.params } }\n"
                      << "  opt: { type: optimizer, in: { grads: fb.grads, model: model.params }, with: { lr: " << kLr << " } }\n";
  return steps / bench::time_graph("train_loop_bench", y.str(), steps, kSeed, prefetch);
}

void compare(const char* name, const std::string& data, int steps, int delay_ms, double target) {
  std::vector<double> loop, graph;
  hand_loop(data, 3, 0);  // warm up allocators and code paths
  for (int round = 0; round < 3; ++round) {
    loop.push_back(hand_loop(data, steps, delay_ms));
    graph.push_back(graph_run(data, steps, delay_ms, 2));
  }
  const double l = bench::median(loop), gr = bench::median(graph);
  std::printf("%-12s delay %3d ms   loop %6.2f steps/s   flowrun %6.2f steps/s   ratio %.3f   (target >= %.2f: %s)\n", name,
              delay_ms, l, gr, gr / l, target, gr / l >= target ? "met" : "NOT met");
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 40, delay = 60;
  std::string data = "data/text/fortunes_byte";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--steps") steps = std::stoi(argv[i + 1]);
    else if (a == "--delay-ms") delay = std::stoi(argv[i + 1]);
    else if (a == "--data") data = argv[i + 1];
    else return std::fprintf(stderr, "unknown option %s\n", a.c_str()), 2;
  }
  if (!std::filesystem::exists(data + ".train.bin"))
    return std::fprintf(stderr, "%s.train.bin is missing: run scripts/data.sh\n", data.c_str()), 2;
  at::set_num_threads(static_cast<int>(std::thread::hardware_concurrency()));
  std::printf("GPT %lldx%lld, %lld heads, %lld tokens x %lld, byte vocab; %d steps per round, median of 3 rounds\n",
              (long long)kLayers, (long long)kDim, (long long)kHeads, (long long)kT, (long long)kBatch, steps);
  compare("plain", data, steps, 0, 0.97);
  compare("slow reader", data, steps, delay, 1.3);
  return 0;
}
