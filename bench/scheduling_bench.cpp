// Scheduling overhead of the executor per node per step, against a bare tbb::flow chain.
//
// Graphs of trivial nodes (each does one integer add), run for many steps:
//   chain8     src -> op1 -> ... -> op7                     (8 nodes in a line)
//   fan8       src -> 8 independent ops -> join             (10 nodes, fan-out/fan-in)
//   state8     a state cell; 4 readers and 4 writers interleaved in file order
// Counter us_per_node_step: wall time / (steps * nodes). x_bare_tbb: that over the cost per
// node-message of a bare chain of 8 tbb::flow::function_nodes pushing the same number of
// messages, measured in the same process.
#include <benchmark/benchmark.h>
#include <tbb/flow_graph.h>
#include <tbb/global_control.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "executor.hpp"
#include "registry.hpp"
#include "spec.hpp"

using namespace flowrun;

namespace {

constexpr int kSteps = 2000;

struct Counter {
  int64_t v = 0;
};

class Src : public Node {
 public:
  void run(StepContext& c) override { c.out("out", c.step()); }
};
class Op : public Node {
 public:
  void run(StepContext& c) override {
    int64_t s = c.step();
    if (c.connected("in"))
      for (const Value* v : c.in_all("in")) s += *v->get_if<int64_t>();
    c.out("out", s);
  }
};
class Cell : public Node {
 public:
  void setup(SetupContext& c) override { c.own_state("cell", std::make_shared<Counter>()); }
  void run(StepContext&) override {}
};
template <bool Write>
class Access : public Node {
 public:
  void run(StepContext& c) override {
    auto& x = c.state_as<Counter>("s");
    if (Write) ++x.v;
    benchmark::DoNotOptimize(x.v);
  }
};

void register_bench_nodes() {
  static bool done = false;
  if (done) return;
  done = true;
  Registry& r = Registry::global();
  r.add("type: b_src\noutputs: { out: { kind: value, type: int } }", [] { return std::make_unique<Src>(); }, "bench");
  r.add("type: b_op\ninputs: { in: { kind: value, type: int, many: true, optional: true } }\n"
        "outputs: { out: { kind: value, type: int } }",
        [] { return std::make_unique<Op>(); }, "bench");
  r.add("type: b_cell\noutputs: { cell: { kind: state, type: cell } }", [] { return std::make_unique<Cell>(); }, "bench");
  r.add("type: b_read\ninputs: { s: { kind: state, access: read, type: cell } }",
        [] { return std::make_unique<Access<false>>(); }, "bench");
  r.add("type: b_write\ninputs: { s: { kind: state, access: write, type: cell } }",
        [] { return std::make_unique<Access<true>>(); }, "bench");
}

std::string graph_text(const std::string& kind, int& nodes) {
  std::ostringstream o;
  o << "flowrun: 1\nrun: { steps: " << kSteps << ", prefetch: 2 }\nnodes:\n";
  if (kind == "chain8") {
    o << "  n0: { type: b_src }\n";
    for (int i = 1; i < 8; ++i) o << "  n" << i << ": { type: b_op, in: { in: [n" << i - 1 << ".out] } }\n";
    nodes = 8;
  } else if (kind == "fan8") {
    o << "  src: { type: b_src }\n";
    std::string join;
    for (int i = 0; i < 8; ++i) {
      o << "  op" << i << ": { type: b_op, in: { in: [src.out] } }\n";
      join += (i ? ", op" : "op") + std::to_string(i) + ".out";
    }
    o << "  join: { type: b_op, in: { in: [" << join << "] } }\n";
    nodes = 10;
  } else {  // state8
    o << "  cell: { type: b_cell }\n";
    for (int i = 0; i < 8; ++i) o << "  a" << i << ": { type: " << (i % 2 ? "b_write" : "b_read") << ", in: { s: cell.cell } }\n";
    nodes = 8;  // the cell owner has no per-step work; it is not counted
  }
  return o.str();
}

// Bare tbb::flow: 8 serial function_nodes in a chain, `msgs` messages. µs per node-message.
double bare_tbb_us_per_node_message() {
  static double cached = [] {
    const int msgs = kSteps * 20;
    double best = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
      tbb::flow::graph g;
      std::vector<std::unique_ptr<tbb::flow::function_node<int64_t, int64_t>>> fns;
      for (int i = 0; i < 8; ++i)
        fns.emplace_back(new tbb::flow::function_node<int64_t, int64_t>(g, tbb::flow::serial, [](int64_t v) { return v + 1; }));
      for (int i = 0; i + 1 < 8; ++i) tbb::flow::make_edge(*fns[i], *fns[i + 1]);
      auto t0 = std::chrono::steady_clock::now();
      for (int m = 0; m < msgs; ++m) fns[0]->try_put(m);
      g.wait_for_all();
      double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      best = std::min(best, us / (msgs * 8.0));
    }
    return best;
  }();
  return cached;
}

void BM_Executor(benchmark::State& state, const std::string& kind) {
  register_bench_nodes();
  int nodes = 0;
  const std::string file = (std::filesystem::temp_directory_path() / ("flowrun_bench_" + kind + ".yaml")).string();
  std::ofstream(file) << graph_text(kind, nodes);
  GraphSpec g = load_graph(file, {}, Registry::global());
  RunInfo info;
  info.last_step = kSteps;
  Executor ex(g, Registry::global(), info);
  RunOptions opt;
  opt.prefetch = 2;
  opt.workers = 2;
  double total_us = 0;
  int64_t runs = 0;
  for (auto _ : state) {
    auto t0 = std::chrono::steady_clock::now();
    ex.run(opt);
    total_us += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    ++runs;
  }
  const double per = total_us / (static_cast<double>(runs) * kSteps * nodes);
  state.counters["us_per_node_step"] = per;
  state.counters["x_bare_tbb"] = per / bare_tbb_us_per_node_message();
  state.SetItemsProcessed(state.iterations() * kSteps * nodes);
}

void BM_BareTbbChain8(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(bare_tbb_us_per_node_message());
  state.counters["us_per_node_message"] = bare_tbb_us_per_node_message();
}

}  // namespace

BENCHMARK_CAPTURE(BM_Executor, chain8, std::string("chain8"))->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK_CAPTURE(BM_Executor, fan8, std::string("fan8"))->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK_CAPTURE(BM_Executor, state8, std::string("state8"))->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(BM_BareTbbChain8)->Iterations(1);

BENCHMARK_MAIN();
