// What seeing where the time goes costs a training step (issue 16: < 1 % of the GPT bench step).
//
//   log_line      one logged metrics line as `metrics` writes it with tensorboard: true: a
//                 Summary of 5 scalars appended to the event file and flushed
//   grid          the sampler's image: a 512x128 RGB grid encoded as PNG, appended and flushed
//   profile_step  run.profile / run.trace: one GPT graph step's node spans recorded with their
//                 dependencies (11 nodes, 3 deps each, as the executor records them), plus that
//                 step's share of the profile computed at the end (make_profile over 1000 steps)
//   tally_step    the progress line's slowest node: one step's 11 spans tallied (no recording)
//
// Counter pct_of_gpt_step: the time per call over the GPT bench step on this machine, 364 ms
// (2.75 steps/s, bench/README.md): the cost if it happened every step.
// Run: build/bench/observability_bench (writes into a temporary folder, removed at the end).
#include <benchmark/benchmark.h>

#include <chrono>
#include <filesystem>

#include "formats/tfevents.hpp"
#include "formats/image_io.hpp"
#include "profile.hpp"
#include "spec.hpp"
#include "trace.hpp"

namespace {

constexpr double kGptBenchStepSeconds = 1.0 / 2.75;

std::string temp_folder() {
  static const std::string dir = (std::filesystem::temp_directory_path() / "flowrun_observability_bench").string();
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

// graphs/gpt.yaml's nodes, each waiting for three instances as a step of it does.
const char* const kGptNodes[] = {"data", "model", "loss", "fb", "sync", "opt", "ema", "log", "eval", "evlog", "ckpt"};

void record_step(flowrun::Tracer& t, int64_t step) {
  for (int k = 0; k < 11; ++k) {
    const double t0 = t.now_us();
    t.node_span(kGptNodes[k], "type", t0, t0 + 1.0, step, "",
                {{kGptNodes[k], step - 1}, {kGptNodes[(k + 10) % 11], step}, {"opt", step - 1}});
  }
}

void profile_step(benchmark::State& state) {
  flowrun::GraphSpec g;
  for (const char* n : kGptNodes) {
    flowrun::NodeSpec s;
    s.name = n;
    s.type = "type";
    g.nodes.push_back(s);
  }
  constexpr int64_t kSteps = 1000;
  const auto t0 = Clock::now();
  int64_t steps = 0;
  for (auto _ : state) {
    flowrun::Tracer t;
    t.enable(true);
    for (int64_t s = 1; s <= kSteps; ++s) record_step(t, s);
    benchmark::DoNotOptimize(flowrun::make_profile(g, t.node_spans()));
    steps += kSteps;
  }
  const double per_step = std::chrono::duration<double>(Clock::now() - t0).count() / static_cast<double>(steps);
  state.counters["us_per_step"] = per_step * 1e6;
  state.counters["pct_of_gpt_step"] = 100.0 * per_step / kGptBenchStepSeconds;
}
BENCHMARK(profile_step)->Unit(benchmark::kMillisecond);

void tally_step(benchmark::State& state) {
  flowrun::Tracer t;
  t.enable_tally(true);
  int64_t step = 0;
  const auto t0 = Clock::now();
  for (auto _ : state) record_step(t, ++step);
  report(state, Clock::now() - t0);
}
BENCHMARK(tally_step);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  std::filesystem::remove_all(temp_folder());
  return 0;
}
