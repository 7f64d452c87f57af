// Shared by the benchmarks that time a flowrun graph against a hand-written loop.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/torch_setup.hpp"
#include "executor.hpp"
#include "registry.hpp"
#include "spec.hpp"

namespace flowrun::bench {

// Seconds to run the graph `yaml` (a complete graph file's text; `name` names its temporary
// file) for steps 1..steps with run seed `seed` and `prefetch`; setup is not timed.
inline double time_graph(const std::string& name, const std::string& yaml, int64_t steps, uint64_t seed, int prefetch) {
  const std::string file = (std::filesystem::temp_directory_path() / ("flowrun_" + name + ".yaml")).string();
  std::ofstream(file) << yaml;
  GraphSpec g = load_graph(file, {}, Registry::global());
  RunInfo info;
  info.last_step = steps;
  info.seed = seed;
  Executor ex(g, Registry::global(), info);
  RunOptions opt = run_options(g);  // run.compute_thread as the CLI runs it
  opt.prefetch = prefetch;
  opt.on_worker_thread = worker_thread_setup;
  const auto t0 = std::chrono::steady_clock::now();
  ex.run(opt);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace flowrun::bench
