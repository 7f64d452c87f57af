// What TensorBoard logging costs a training step (issue 16: < 1 % of the GPT bench step).
//
//   log_line   one logged metrics line as `metrics` writes it with tensorboard: true: a Summary of
//              5 scalars (loss, lr, grad_norm, tokens_per_s, steps_per_s) appended and flushed
//   grid       the sampler's image: a 512x128 RGB grid encoded as PNG, appended and flushed
//
// Counter pct_of_gpt_step: the time per call over the GPT bench step on this machine, 364 ms
// (2.75 steps/s, bench/README.md) — the cost if every step were logged (run.log_every=1).
// Run: build/bench/tfevents_bench (writes into a temporary folder, removed at the end).
#include <benchmark/benchmark.h>

#include <chrono>
#include <filesystem>

#include "common/tfevents.hpp"
#include "data/image_io.hpp"

namespace {

constexpr double kGptBenchStepSeconds = 1.0 / 2.75;

std::string temp_folder() {
  static const std::string dir = (std::filesystem::temp_directory_path() / "flowrun_tfevents_bench").string();
  return dir;
}

using Clock = std::chrono::steady_clock;

void report(benchmark::State& state, Clock::duration spent) {
  const double per_call = std::chrono::duration<double>(spent).count() / static_cast<double>(state.iterations());
  state.counters["pct_of_gpt_step"] = 100.0 * per_call / kGptBenchStepSeconds;
}

void log_line(benchmark::State& state) {
  auto f = flowrun::tfevents::EventFile::open(temp_folder() + "/log_line");
  int64_t step = 0;
  const auto t0 = Clock::now();
  for (auto _ : state) {
    ++step;
    f->scalars(step, {{"log/loss", 2.5 / step}, {"log/lr", 3e-4}, {"log/grad_norm", 0.7}, {"log/tokens_per_s", 5632.0},
                      {"log/steps_per_s", 2.75}});
    f->flush();
  }
  report(state, Clock::now() - t0);
}
BENCHMARK(log_line);

void grid(benchmark::State& state) {
  auto f = flowrun::tfevents::EventFile::open(temp_folder() + "/grid");
  flowrun::Image img(512, 128);
  for (size_t i = 0; i < img.px.size(); ++i) img.px[i] = static_cast<uint8_t>((i * 7) ^ (i >> 9));
  int64_t step = 0;
  const auto t0 = Clock::now();
  for (auto _ : state) {
    f->image(++step, "sample", flowrun::encode_png(img), img.h, img.w, img.c);
    f->flush();
  }
  report(state, Clock::now() - t0);
}
BENCHMARK(grid);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  std::filesystem::remove_all(temp_folder());
  return 0;
}
