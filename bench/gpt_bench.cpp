// gpt training step on the CPU: forward + backward of the lm objective + an AdamW update,
// for the gpt node's module (nodes/models/gpt/gpt.cpp) and for a line-by-line transcription of
// Hugging Face's GPT-2 forward over the same parameters (tests/support/gpt_reference.hpp).
// The time column is ms per step (wall clock); tokens_per_s counts target tokens. The ratio
// fast / reference is the speed-up of the hot-path choices. Results: bench/README.md.
//   ./build/bench/gpt_bench [--benchmark_filter=...]
#include <benchmark/benchmark.h>

#include "common/seed.hpp"
#include "models/gpt/gpt.hpp"
#include "support/gpt_reference.hpp"
#include "train/forward_backward.hpp"
#include "train/losses.hpp"
#include "train/optimizer.hpp"

namespace {

using namespace flowrun;

// The case of the GPT issue: 2 layers, 128 wide, 4 heads, batch 32 of 64 tokens.
constexpr int64_t kLayers = 2, kDim = 128, kHeads = 4, kBatch = 32, kT = 64;

void BM_GptStep(benchmark::State& state, bool reference, Precision precision = Precision::fp32) {
  const int64_t vocab = state.range(0);
  gpt::Config c;
  c.layers = kLayers;
  c.dim = kDim;
  c.heads = kHeads;
  c.vocab = vocab;
  c.context = kT;
  gpt::Gpt m(c);
  gpt::init_weights(*m, 1);
  std::shared_ptr<ModelState> model = gpt::make_state(m);
  if (reference)
    model->forward_fn = [](torch::nn::Module& mod, const TensorMap& b) {
      const torch::Tensor& t = b.at("tokens");
      return test::hf_gpt2_reference_forward(*mod.as<gpt::GptImpl>(), t.narrow(1, 0, t.size(1) - 1));
    };
  at::Generator g = make_cpu_generator(3);
  TensorMap batch = {{"tokens", torch::randint(vocab, {kBatch, kT + 1}, g, torch::kLong)}};
  OptimizerState opt;
  OptimConfig cfg;
  cfg.weight_decay = 0.1;
  const LmLoss lm;
  FwdBwdOptions o;
  o.precision = precision;
  auto step = [&] {
    FwdBwdResult r = forward_backward(*model, batch, lm, o);
    optimizer_update(opt, model->named_parameters(true), r.grads, cfg, 1e-4);
  };
  step();  // warm-up: allocations, the mask cache, optimizer moments
  for (auto _ : state) step();
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations() * kBatch * kT), benchmark::Counter::kIsRate);
}

void BM_Reference(benchmark::State& state) {
  BM_GptStep(state, true);
}
void BM_Fast(benchmark::State& state) {
  BM_GptStep(state, false);
}

// bf16 autocast on the CPU (run.precision: bf16).
void BM_FastBf16(benchmark::State& state) {
  BM_GptStep(state, false, Precision::bf16);
}

BENCHMARK(BM_Reference)->Arg(512)->Arg(50257)->Unit(benchmark::kMillisecond)->MinTime(3.0)->UseRealTime();
BENCHMARK(BM_Fast)->Arg(512)->Arg(50257)->Unit(benchmark::kMillisecond)->MinTime(3.0)->UseRealTime();
BENCHMARK(BM_FastBf16)->Arg(512)->Arg(50257)->Unit(benchmark::kMillisecond)->MinTime(3.0)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
