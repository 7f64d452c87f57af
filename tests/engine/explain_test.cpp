// `flowrun explain`: the step written out in file order, and its waits are the ones the executor
// derives when it runs the graph (both use engine/step_order.hpp; this checks it instance by
// instance against a run's trace).
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "explain.hpp"
#include "executor.hpp"
#include "registry.hpp"
#include "spec.hpp"
#include "support/run_graph.hpp"
#include "support/test_nodes.hpp"
#include "trace.hpp"

using namespace flowrun;

namespace {

// A step's graph: values, a stream, a stateless node, two readers and two writers of one state
// (a read after a write, a write after reads), a compute-type node.
const char* kGraph = R"(flowrun: 1
name: explained
run: { steps: 4, prefetch: 1 }
nodes:
  src:  { type: t_source }
  cell: { type: t_cell }
  fwd:  { type: t_read, in: { s: cell.cell, in: [src.out] } }
  par:  { type: t_par, in: { in: [src.out] } }
  opt:  { type: t_write, in: { s: cell.cell, in: [fwd.out] } }
  ema:  { type: t_read, in: { s: cell.cell } }
  math: { type: t_math, in: { in: [par.out, ema.out] } }
  bwd:  { type: t_stream }
  red:  { type: t_sink, in: { items: bwd.items } }
  last: { type: t_write, in: { s: cell.cell, in: [red.out] } }
)";

// "waits for" lines of the explanation, per node: {(node, steps back)}.
std::map<std::string, std::set<std::pair<std::string, int>>> explained_waits(const std::string& text) {
  std::map<std::string, std::set<std::pair<std::string, int>>> out;
  std::istringstream in(text);
  std::string line, node;
  const std::regex head(R"(^\s+\d+\. (\w+)\s+= )"), dep(R"((\w+)@s(-(\d+))?)");
  while (std::getline(in, line)) {
    std::smatch m;
    if (std::regex_search(line, m, head)) {
      node = m[1];
      out[node];
      continue;
    }
    const size_t at = line.find("waits for ");
    if (at == std::string::npos || node.empty()) continue;
    const std::string rest = line.substr(at + 10);
    for (auto it = std::sregex_iterator(rest.begin(), rest.end(), dep); it != std::sregex_iterator(); ++it)
      out[node].insert({(*it)[1], (*it)[3].matched ? std::stoi((*it)[3]) : 0});
  }
  return out;
}

}  // namespace

TEST(Explain, WritesTheStepInFileOrderWithWhereEachNodeRuns) {
  test::register_test_nodes();
  const std::string dir = test::temp_dir("explain");
  std::ofstream(dir + "/g.yaml") << kGraph;
  GraphSpec g = load_graph(dir + "/g.yaml", {}, Registry::global());
  const std::string text = explain(g, Registry::global());
  EXPECT_NE(text.find("up to run.prefetch + 1 = 2 steps"), std::string::npos) << text;
  EXPECT_NE(text.find(" 3. fwd  = t_read(s reads cell.cell, in = src.out)"), std::string::npos) << text;
  EXPECT_NE(text.find(" 4. par  = t_par(in = src.out)   [stateless: steps may overlap]"), std::string::npos) << text;
  EXPECT_NE(text.find(" 7. math = t_math(in = [par.out, ema.out])   [compute thread]"), std::string::npos) << text;
  EXPECT_NE(text.find("owns cell.cell (state, made at setup)"), std::string::npos) << text;
  EXPECT_NE(text.find("waits for src@s (out), fwd@s-1 (its previous step), last@s-1 (wrote cell.cell)"), std::string::npos)
      << text;
  EXPECT_NE(text.find("red  = t_sink(items streams bwd.items)"), std::string::npos) << text;
  EXPECT_NE(text.find("bwd@s (stream items: each item as it comes, then its end)"), std::string::npos) << text;
  // A write waits for the last write and every read since it.
  EXPECT_NE(text.find("waits for red@s (out), last@s-1 (its previous step), opt@s (wrote cell.cell before), "
                      "ema@s (reads cell.cell)"),
            std::string::npos)
      << text;
}

// What explain says each node waits for in a step is what the executor made it wait for in
// step 3 of a run (the trace records each instance's dependencies).
TEST(Explain, ItsWaitsAreTheExecutorsInARun) {
  test::register_test_nodes();
  const std::string dir = test::temp_dir("explain");
  std::ofstream(dir + "/g.yaml") << kGraph;
  GraphSpec g = load_graph(dir + "/g.yaml", {}, Registry::global());
  const auto said = explained_waits(explain(g, Registry::global()));
  ASSERT_EQ(said.size(), g.nodes.size());

  Tracer tracer;
  tracer.enable(true);
  RunOptions opt;
  opt.tracer = &tracer;
  test::run_graph_text(kGraph, {}, opt);
  std::map<std::string, std::set<std::pair<std::string, int>>> ran;
  for (const TraceSpan& span : tracer.node_spans()) {
    if (span.step != 3) continue;
    auto& deps = ran[span.node];
    for (const auto& [node, step] : span.deps) deps.insert({node, static_cast<int>(3 - step)});
  }
  for (const auto& ns : g.nodes) EXPECT_EQ(said.at(ns.name), ran[ns.name]) << ns.name;
}
