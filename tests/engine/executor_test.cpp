// Executor: the sequential semantics under parallel execution, overlap, streams, failures.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <map>
#include <set>
#include <random>
#include <regex>
#include <sstream>

#include "registry.hpp"
#include "support/run_graph.hpp"
#include "support/test_nodes.hpp"
#include "trace.hpp"

using namespace flowrun;
using test::Recorder;

namespace {

struct RandNode {
  std::string name, type;
  std::vector<int> ins;  // indices of value producers
  int cell = -1;
  int every = 0;
  int k = 0;
};

// A random graph of test nodes: one source, a few state cells, ops/readers/writers with random
// value edges, random state accesses, some periodic, random sleeps.
std::vector<RandNode> random_graph(std::mt19937& rng, int cells, bool math = false) {
  std::vector<RandNode> g;
  g.push_back({"src", "t_source", {}, -1, 0, static_cast<int>(rng() % 100)});
  const int m = 4 + static_cast<int>(rng() % 6);
  const char* types[] = {"t_op", "t_par", "t_read", "t_write", "t_write", "t_read"};
  for (int i = 0; i < m; ++i) {
    RandNode n;
    n.name = "n" + std::to_string(i);
    n.type = types[rng() % 6];
    if (math && n.type == "t_op" && rng() % 2 == 0) n.type = "t_math";  // on the compute thread
    // Value inputs only from non-periodic producers (a periodic value needs a periodic reader).
    std::vector<int> candidates;
    for (size_t j = 0; j < g.size(); ++j)
      if (g[j].every == 0) candidates.push_back(static_cast<int>(j));
    int nin = static_cast<int>(rng() % 3);
    for (int j = 0; j < nin; ++j) n.ins.push_back(candidates[rng() % candidates.size()]);
    if (n.type == "t_read" || n.type == "t_write") n.cell = static_cast<int>(rng() % cells);
    if (rng() % 4 == 0) n.every = 2 + static_cast<int>(rng() % 2);
    g.push_back(n);
  }
  return g;
}

std::string to_yaml(const std::vector<RandNode>& g, int cells, int steps, int prefetch, int workers) {
  std::ostringstream o;
  o << "flowrun: 1\nrun: { steps: " << steps << ", prefetch: " << prefetch << ", workers: " << workers << " }\nnodes:\n";
  for (int c = 0; c < cells; ++c) o << "  c" << c << ": { type: t_cell }\n";
  for (const auto& n : g) {
    o << "  " << n.name << ": { type: " << n.type;
    if (n.every) o << ", every: " << n.every;
    o << ", in: {";
    bool first = true;
    if (!n.ins.empty()) {
      o << " in: [";
      for (size_t j = 0; j < n.ins.size(); ++j) o << (j ? ", " : "") << g[n.ins[j]].name << ".out";
      o << "]";
      first = false;
    }
    if (n.cell >= 0) o << (first ? "" : ",") << " s: c" << n.cell << ".cell";
    o << " }, with: {";
    if (n.type == "t_source")
      o << " k: " << n.k;
    else
      o << " jitter_us: 400";
    o << " } }\n";
  }
  return o.str();
}

// What the sequential program records: (node, step) -> value (outputs, or the version seen).
std::map<std::pair<std::string, int64_t>, int64_t> sequential(const std::vector<RandNode>& g, int cells, int steps) {
  std::map<std::pair<std::string, int64_t>, int64_t> rec;
  std::vector<int64_t> version(cells, 0);
  for (int64_t s = 1; s <= steps; ++s) {
    std::vector<int64_t> out(g.size(), 0);
    for (size_t i = 0; i < g.size(); ++i) {
      const RandNode& n = g[i];
      if (n.every && s % n.every != 0) continue;
      int64_t sum = 0;
      for (int j : n.ins) sum += out[j];
      if (n.type == "t_source") {
        out[i] = s * 1000 + n.k;
        rec[{n.name, s}] = out[i];
      } else if (n.type == "t_op" || n.type == "t_par" || n.type == "t_math") {
        out[i] = s * 1000 + sum % 1000;
        rec[{n.name, s}] = out[i];
      } else {
        int64_t seen = version[n.cell];
        rec[{n.name, s}] = seen;
        out[i] = s * 1000 + (sum + seen) % 1000;
        if (n.type == "t_write") version[n.cell] = seen + 1;
      }
    }
  }
  return rec;
}

}  // namespace

// The property the whole executor exists for: running in parallel, with prefetch and random
// timings, every node sees exactly what the sequential program would have shown it.
TEST(Executor, RandomGraphsMatchTheSequentialProgram) {
  std::mt19937 rng(12345);
  for (int trial = 0; trial < 25; ++trial) {
    const int cells = 1 + static_cast<int>(rng() % 3);
    const int steps = 20 + static_cast<int>(rng() % 20);
    const int prefetch = static_cast<int>(rng() % 5);
    const int workers = 2 + static_cast<int>(rng() % 3);
    auto g = random_graph(rng, cells);
    std::string yaml = to_yaml(g, cells, steps, prefetch, workers);
    Recorder::get().clear();
    test::run_graph_text(yaml);
    auto expect = sequential(g, cells, steps);
    std::map<std::pair<std::string, int64_t>, int64_t> got;
    for (const auto& e : Recorder::get().events()) got[{e.node, e.step}] = e.value;
    ASSERT_EQ(Recorder::get().violations(), 0) << "overlapping write in trial " << trial << "\n" << yaml;
    ASSERT_EQ(got.size(), expect.size()) << yaml;
    for (const auto& [key, v] : expect)
      ASSERT_EQ(got[key], v) << "node " << key.first << " step " << key.second << " trial " << trial << "\n" << yaml;
  }
}

// The same with some nodes on the compute thread (RunOptions::compute_thread), handed there
// from the workers and completing from there.
TEST(Executor, RandomGraphsWithAComputeThreadMatchTheSequentialProgram) {
  std::mt19937 rng(777);
  for (int trial = 0; trial < 25; ++trial) {
    const int cells = 1 + static_cast<int>(rng() % 3);
    const int steps = 20 + static_cast<int>(rng() % 20);
    const int prefetch = static_cast<int>(rng() % 5);
    const int workers = 2 + static_cast<int>(rng() % 3);
    auto g = random_graph(rng, cells, /*math=*/true);
    std::string yaml = to_yaml(g, cells, steps, prefetch, workers);
    Recorder::get().clear();
    test::run_graph_text(yaml);
    auto expect = sequential(g, cells, steps);
    std::map<std::pair<std::string, int64_t>, int64_t> got;
    for (const auto& e : Recorder::get().events()) got[{e.node, e.step}] = e.value;
    ASSERT_EQ(Recorder::get().violations(), 0) << "overlapping write in trial " << trial << "\n" << yaml;
    ASSERT_EQ(got.size(), expect.size()) << yaml;
    for (const auto& [key, v] : expect)
      ASSERT_EQ(got[key], v) << "node " << key.first << " step " << key.second << " trial " << trial << "\n" << yaml;
  }
}

// run.compute_thread: nodes of compute types run on the thread that called run() (one thread
// for the tensor math: one OpenMP team), everything else on the workers, which get
// on_worker_thread once each; a reader on the workers still runs ahead of the math.
TEST(Executor, ComputeNodesRunOnTheCallingThreadAndReadersOverlapThem) {
  const char* yaml = R"(flowrun: 1
run: { steps: 30, prefetch: 2, workers: 2 }
nodes:
  reader: { type: t_source, with: { sleep_ms: 20 } }
  train: { type: t_math, in: { in: [reader.out] }, with: { sleep_us: 20000 } }
  opt: { type: t_math, in: { in: [train.out] } }
  log: { type: t_op, in: { in: [opt.out] } }
)";
  std::mutex mu;
  std::set<std::thread::id> initialised;
  int inits = 0;
  RunOptions opt;
  opt.on_worker_thread = [&] {
    std::lock_guard<std::mutex> l(mu);
    initialised.insert(std::this_thread::get_id());
    ++inits;
  };
  Recorder::get().clear();
  auto t0 = std::chrono::steady_clock::now();
  test::run_graph_text(yaml, {}, opt);
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto me = std::this_thread::get_id();
  std::set<std::thread::id> worker_threads;
  for (const auto& e : Recorder::get().events()) {
    if (e.node == "train" || e.node == "opt") {
      EXPECT_EQ(e.thread, me) << e.node << " step " << e.step << " ran on a worker";
    } else {
      EXPECT_NE(e.thread, me) << e.node << " step " << e.step << " ran on the compute thread";
      worker_threads.insert(e.thread);
    }
  }
  EXPECT_EQ(Recorder::get().events().size(), 4u * 30);
  // Each worker was set up once, before its first node; never the compute thread.
  EXPECT_EQ(initialised.size(), static_cast<size_t>(inits));
  EXPECT_EQ(initialised.count(me), 0u);
  for (const auto& w : worker_threads) EXPECT_EQ(initialised.count(w), 1u);
  // The reader (20 ms) runs ahead while the compute thread trains (20 ms): ~0.6 s, not 1.2.
  const double serial = 30 * 0.040;
  EXPECT_LT(t, 0.75 * serial) << "took " << t << " s; serial is " << serial << " s";

  // Off: compute types run on the workers like any node, and workers keep their settings.
  Recorder::get().clear();
  inits = 0;
  test::run_graph_text(yaml, {"run.compute_thread=false", "run.steps=5"}, opt);
  EXPECT_EQ(inits, 0);
}

TEST(Executor, AFailureOnTheComputeThreadStopsTheRunWithNodeAndStep) {
  const char* yaml = R"(flowrun: 1
run: { steps: 1000, prefetch: 2 }
nodes:
  src: { type: t_source, with: { sleep_ms: 2 } }
  boom: { type: t_math, in: { in: [src.out] }, with: { fail_at: 5 } }
  after: { type: t_math, in: { in: [boom.out] } }
)";
  Recorder::get().clear();
  try {
    test::run_graph_text(yaml);
    FAIL() << "expected NodeError";
  } catch (const NodeError& e) {
    EXPECT_EQ(std::string(e.what()), "node 'boom' (t_math) failed at step 5: boom (test failure)");
    EXPECT_EQ(e.step, 5);
  }
  int64_t max_step = 0;
  for (const auto& e : Recorder::get().events()) max_step = std::max(max_step, e.step);
  EXPECT_LE(max_step, 5 + 3);
}

TEST(Executor, PrefetchOverlapsReaderAndConsumer) {
  const char* yaml = R"(flowrun: 1
run: { steps: 30, prefetch: 2, workers: 2 }
nodes:
  reader: { type: t_source, with: { sleep_ms: 20 } }
  train: { type: t_op, in: { in: [reader.out] }, with: { sleep_us: 20000 } }
)";
  auto t0 = std::chrono::steady_clock::now();
  test::run_graph_text(yaml);
  double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double serial = 30 * 0.040;
  EXPECT_LT(t, 0.75 * serial) << "took " << t << " s; serial is " << serial << " s";
  // With no prefetch the two alternate: no overlap, about the serial time.
  t0 = std::chrono::steady_clock::now();
  test::run_graph_text(yaml, {"run.prefetch=0"});
  double t_serial = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GT(t_serial, 0.95 * serial);
}

TEST(Executor, StatelessNodesRunStepsInParallel) {
  const char* yaml = R"(flowrun: 1
run: { steps: 20, prefetch: 3, workers: 4 }
nodes:
  src: { type: t_source }
  work: { type: t_par, in: { in: [src.out] }, with: { sleep_us: 20000 } }
)";
  auto t0 = std::chrono::steady_clock::now();
  test::run_graph_text(yaml);
  double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(t, 0.5 * 20 * 0.020) << t;  // 4 at a time: ~0.25x serial
}

TEST(Executor, ReadsOfOneVersionOverlapWritesDoNot) {
  // Like EMA (read) of step s overlapping forward (read) of step s+1, both after opt (write).
  const char* yaml = R"(flowrun: 1
run: { steps: 6, prefetch: 2, workers: 3 }
nodes:
  params: { type: t_cell }
  fwd: { type: t_read, in: { s: params.cell }, with: { sleep_us: 15000 } }
  opt: { type: t_write, in: { s: params.cell }, with: { sleep_us: 5000 } }
  ema: { type: t_read, in: { s: params.cell }, with: { sleep_us: 15000 } }
)";
  Recorder::get().clear();
  test::run_graph_text(yaml);
  EXPECT_EQ(Recorder::get().violations(), 0);
  std::map<std::pair<std::string, int64_t>, test::Event> ev;
  for (const auto& e : Recorder::get().events()) ev[{e.node, e.step}] = e;
  int overlaps = 0;
  for (int64_t s = 1; s < 6; ++s) {
    const auto& ema = ev[{"ema", s}];
    const auto& fwd = ev[{"fwd", s + 1}];
    const auto& opt = ev[{"opt", s + 1}];
    EXPECT_EQ(ema.value, fwd.value);           // same version
    EXPECT_GE(opt.t0_ms, ema.t1_ms - 0.01);    // the next write waits for the EMA read
    if (fwd.t0_ms < ema.t1_ms && ema.t0_ms < fwd.t1_ms) ++overlaps;
  }
  EXPECT_GE(overlaps, 4) << "EMA of step s should run concurrently with forward of step s+1";
}

TEST(Executor, StreamItemsAreConsumedWhileTheProducerRuns) {
  const char* yaml = R"(flowrun: 1
run: { steps: 3, workers: 2 }
nodes:
  bwd: { type: t_stream, with: { count: 4, sleep_ms: 15 } }
  reduce: { type: t_sink, in: { items: bwd.items }, with: { sleep_ms: 5 } }
  after: { type: t_op, in: { in: [reduce.out] } }
)";
  Recorder::get().clear();
  test::run_graph_text(yaml);
  std::map<int64_t, std::vector<test::Event>> items, emits;
  std::map<int64_t, test::Event> runs, after;
  for (const auto& e : Recorder::get().events()) {
    if (e.what == "item") items[e.step].push_back(e);
    if (e.what == "emit") emits[e.step].push_back(e);
    if (e.node == "reduce" && e.what == "run") runs[e.step] = e;
    if (e.node == "after") after[e.step] = e;
  }
  for (int64_t s = 1; s <= 3; ++s) {
    ASSERT_EQ(items[s].size(), 4u);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(items[s][i].value, i);  // in order
    // The first item was handled before the producer emitted its last one.
    EXPECT_LT(items[s][0].t1_ms, emits[s][3].t1_ms);
    EXPECT_EQ(runs[s].value, 4);  // run() after all items
    EXPECT_GE(runs[s].t0_ms, items[s][3].t1_ms);
    EXPECT_EQ(after[s].value, s * 1000 + 4);
  }
}

TEST(Executor, NodeExceptionStopsTheRunPromptlyWithNodeAndStep) {
  const char* yaml = R"(flowrun: 1
run: { steps: 1000, prefetch: 2 }
nodes:
  src: { type: t_source, with: { sleep_ms: 2 } }
  boom: { type: t_fail, in: { in: [src.out] }, with: { at: 5 } }
  after: { type: t_op, in: { in: [src.out] } }
)";
  Recorder::get().clear();
  auto t0 = std::chrono::steady_clock::now();
  try {
    test::run_graph_text(yaml);
    FAIL() << "expected NodeError";
  } catch (const NodeError& e) {
    EXPECT_EQ(std::string(e.what()), "node 'boom' (t_fail) failed at step 5: boom (test failure)");
    EXPECT_EQ(e.node, "boom");
    EXPECT_EQ(e.step, 5);
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0);
  int64_t max_step = 0;
  for (const auto& e : Recorder::get().events()) max_step = std::max(max_step, e.step);
  EXPECT_LE(max_step, 5 + 3);  // nothing beyond the in-flight window ran
}

// Issue 69 §3: a channel is an edge between ranks the graph does not show; a node may open one
// only over a group its schema declares, so explain and dot show every one.
TEST(Executor, ANodeOpensChannelsOnlyOverTheGroupsItsSchemaDeclares) {
  const std::string yaml = R"(flowrun: 1
run: { steps: 2 }
nodes:
  talk: { type: t_channel, with: { group: GROUP } }
)";
  auto with = [&](const std::string& group) { return std::regex_replace(yaml, std::regex("GROUP"), group); };
  EXPECT_NO_THROW(test::run_graph_text(with("dp")));
  for (const std::string group : {"tp", "world"}) {
    try {
      test::run_graph_text(with(group));
      FAIL() << "a channel over " << group << " was let through";
    } catch (const NodeError& e) {
      EXPECT_EQ(e.node, "talk");
      EXPECT_EQ(std::string(e.what()), "node 'talk' (t_channel) opened a channel over the " + group +
                                           " group in setup, but its schema (tests) declares no collectives over " +
                                           group + ": add `collectives: { group: " + group +
                                           ", doc: what it exchanges there }` to it");
    }
  }
}

TEST(Executor, StopFlagEndsAfterTheStepsInFlight) {
  const char* yaml = R"(flowrun: 1
run: { steps: 100, prefetch: 1 }
nodes:
  src: { type: t_source }
  op: { type: t_op, in: { in: [src.out] }, with: { sleep_us: 1000 } }
)";
  std::atomic<int> stop{0};
  std::vector<int64_t> done;
  RunOptions opt;
  opt.stop = &stop;
  opt.on_step_done = [&](int64_t s) {
    done.push_back(s);
    if (s == 5) stop = 1;
  };
  auto r = test::run_graph_text(yaml, {}, opt);
  EXPECT_TRUE(r.stats.stopped);
  EXPECT_GE(r.stats.last_step_done, 5);
  EXPECT_LE(r.stats.last_step_done, 5 + 2);
  for (size_t i = 0; i < done.size(); ++i) EXPECT_EQ(done[i], static_cast<int64_t>(i + 1));  // in order
}

TEST(Executor, PeriodicNodesRunOnlyOnTheirSteps) {
  const char* yaml = R"(flowrun: 1
run: { steps: 10 }
nodes:
  src: { type: t_source }
  every3: { type: t_op, every: 3, in: { in: [src.out] } }
  ends: { type: t_op, at: [start, end] }
)";
  Recorder::get().clear();
  test::run_graph_text(yaml);
  std::vector<int64_t> e3, ends;
  for (const auto& e : Recorder::get().events()) {
    if (e.node == "every3") e3.push_back(e.step);
    if (e.node == "ends") ends.push_back(e.step);
  }
  std::sort(e3.begin(), e3.end());
  std::sort(ends.begin(), ends.end());
  EXPECT_EQ(e3, (std::vector<int64_t>{3, 6, 9}));
  EXPECT_EQ(ends, (std::vector<int64_t>{1, 10}));
}

TEST(Executor, TraceHasASpanPerNodePerStep) {
  const char* yaml = R"(flowrun: 1
run: { steps: 4 }
nodes:
  src: { type: t_source }
  op: { type: t_op, in: { in: [src.out] } }
)";
  Tracer tracer;
  tracer.enable(true);
  RunOptions opt;
  opt.tracer = &tracer;
  auto r = test::run_graph_text(yaml, {}, opt);
  const std::string path = r.dir + "/trace.json";
  tracer.write(path);
  std::ifstream in(path);
  nlohmann::json j = nlohmann::json::parse(in);
  int spans = 0, counters = 0;
  std::set<std::string> counter_names;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "X") {
      ++spans;
      EXPECT_TRUE(e["args"].contains("step"));
      EXPECT_TRUE(e.contains("tid"));
    }
    if (e["ph"] == "C") ++counters, counter_names.insert(e["name"].get<std::string>());
  }
  EXPECT_EQ(spans, 8);
  EXPECT_EQ(counters, 4 + 2 * 8);  // steps in flight per step; nodes ready up and down per node-step
  EXPECT_EQ(counter_names, (std::set<std::string>{"steps in flight", "nodes ready"}));
}

// `at: [stop]`: once more after the last step of a run stopped early (a final checkpoint),
// seeing the state as that step left it; never in a run that ends normally; not twice when
// the node was due in that step anyway.
TEST(Executor, AtStopNodesRunOnceAfterTheLastStepOfAStoppedRun) {
  const char* yaml = R"(flowrun: 1
run: { steps: 100, prefetch: 2 }
nodes:
  src: { type: t_source }
  cell: { type: t_cell }
  w: { type: t_write, in: { s: cell.cell, in: [src.out] }, with: { sleep_us: 500 } }
  final: { type: t_read, at: [stop], in: { s: cell.cell } }
  every2: { type: t_read, every: 2, at: [stop], in: { s: cell.cell } }
)";
  for (int stop_after : {5, 6}) {
    std::atomic<int> stop{0};
    RunOptions opt;
    opt.stop = &stop;
    opt.on_step_done = [&](int64_t s) {
      if (s == stop_after) stop = 1;
    };
    Recorder::get().clear();
    auto r = test::run_graph_text(yaml, {}, opt);
    ASSERT_TRUE(r.stats.stopped);
    const int64_t last = r.stats.last_step_done;
    std::vector<std::pair<int64_t, int64_t>> final, every2_last;  // (step, cell version seen)
    for (const auto& e : Recorder::get().events()) {
      if (e.node == "final") final.push_back({e.step, e.value});
      if (e.node == "every2" && e.step == last) every2_last.push_back({e.step, e.value});
    }
    // One run, at the last finished step, after its write: the cell was written `last` times.
    EXPECT_EQ(final, (std::vector<std::pair<int64_t, int64_t>>{{last, last}})) << stop_after;
    EXPECT_EQ(every2_last.size(), 1u) << "due at step " << last << " or run at stop, never both";
  }
  Recorder::get().clear();
  test::run_graph_text(yaml, {"run.steps=6"});
  for (const auto& e : Recorder::get().events()) EXPECT_NE(e.node, "final") << "ran in a run that was not stopped";
}

// A value output named "*": one port per name that other nodes read, filled by out(name);
// the node sees those names in setup (value_outputs) and out() under a name nobody reads is
// dropped.
namespace {
std::vector<std::string> g_named_outputs_seen;
std::vector<std::pair<std::string, int64_t>> g_named_values;
struct NamedOutputs : Node {
  void setup(SetupContext& c) override { g_named_outputs_seen = c.value_outputs(); }
  void run(StepContext& c) override {
    c.out("fixed", int64_t{1});
    for (const char* n : {"a", "b", "unread"}) c.out(n, c.step() * 10 + (n[0] - 'a'));
  }
};
struct NamedReader : Node {
  void run(StepContext& c) override {
    for (const auto& port : c.input_ports()) g_named_values.push_back({port, c.in<int64_t>(port)});
  }
};
}  // namespace

TEST(Executor, WildcardValueOutputsGiveOnePortPerNameRead) {
  Registry& r = Registry::global();
  r.add("type: t_named\ndoc: named outputs\noutputs:\n  fixed: { kind: value, type: int }\n"
        "  \"*\": { kind: value, type: int }",
        [] { return std::make_unique<NamedOutputs>(); }, "tests");
  r.add("type: t_named_reader\ndoc: reads any ports\ninputs: { \"*\": { kind: value, type: int } }",
        [] { return std::make_unique<NamedReader>(); }, "tests");
  g_named_values.clear();
  test::run_graph_text(R"(
flowrun: 1
run: { steps: 2 }
nodes:
  p: { type: t_named }
  q: { type: t_named_reader, in: { x: p.b, y: p.a, z: p.fixed } }
)");
  EXPECT_EQ(g_named_outputs_seen, (std::vector<std::string>{"a", "b", "fixed"}));
  std::vector<std::pair<std::string, int64_t>> want = {{"x", 11}, {"y", 10}, {"z", 1}, {"x", 21}, {"y", 20}, {"z", 1}};
  EXPECT_EQ(g_named_values, want);
}
