// Overrides (KEY.PATH=VALUE after the file name) and ${...} substitution.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <fstream>

#include "registry.hpp"
#include "spec.hpp"
#include "support/run_graph.hpp"
#include "support/test_nodes.hpp"

using namespace flowrun;

namespace {

std::string write(const std::string& yaml) {
  test::register_test_nodes();
  std::string f = test::temp_dir("ov") + "/g.yaml";
  std::ofstream(f) << yaml;
  return f;
}

const char* kFile = R"(flowrun: 1
run: { steps: 5 }
nodes:
  src: { type: t_source, with: { k: 3 } }
  op: { type: t_op, in: { in: [src.out] } }
)";

std::string errors_of(const std::string& file, const std::vector<std::string>& ov) {
  try {
    load_graph(file, ov, Registry::global());
  } catch (const GraphError& e) {
    return e.diagnostics().str();
  }
  return "";
}

}  // namespace

TEST(Overrides, RunKeyNodeParamAndSchedule) {
  std::string f = write(kFile);
  GraphSpec g = load_graph(f, {"run.steps=50", "src.k=7", "op.every=5", "src.sleep_ms=2"}, Registry::global());
  EXPECT_EQ(g.steps(), 50);
  EXPECT_EQ(g.nodes[0].params["k"].as<int>(), 7);
  EXPECT_EQ(g.nodes[0].params["sleep_ms"].as<int>(), 2);
  EXPECT_EQ(g.nodes[1].schedule.every, 5);
}

TEST(Overrides, RewireAnInput) {
  std::string f = write(R"(flowrun: 1
nodes:
  a: { type: t_source }
  b: { type: t_source, with: { k: 1 } }
  op: { type: t_op, in: { in: [a.out] } }
)");
  GraphSpec g = load_graph(f, {"op.in.in=[b.out]", "op.with.sleep_us=3"}, Registry::global());
  EXPECT_EQ(g.nodes[2].inputs[0].refs[0].node, "b");
  EXPECT_EQ(g.nodes[2].params["sleep_us"].as<int>(), 3);
}

TEST(Overrides, TypedBySchema) {
  std::string f = write(kFile);
  std::string e = errors_of(f, {"run.steps=many"});
  EXPECT_NE(e.find("command line: run.steps: expected int >= 1, got 'many'"), std::string::npos) << e;
}

TEST(Overrides, WrongPathsSayDidYouMean) {
  std::string f = write(kFile);
  std::string e = errors_of(f, {"srx.k=1", "src.kk=1", "run.stpes=3", "noequals"});
  EXPECT_NE(e.find("no node 'srx' in the file (did you mean 'src'?)"), std::string::npos) << e;
  EXPECT_NE(e.find("nodes.src.with.kk: unknown parameter 'kk' (did you mean 'k'?)"), std::string::npos) << e;
  EXPECT_NE(e.find("run.stpes: unknown parameter 'stpes' (did you mean 'steps'?)"), std::string::npos) << e;
  EXPECT_NE(e.find("override 'noequals': an override is KEY.PATH=VALUE"), std::string::npos) << e;
}

TEST(Overrides, NestedParamCreatesMaps) {
  test::register_test_nodes();
  Registry::global().add(R"(type: t_nested
doc: nested params
params:
  lora:
    type: map
    fields:
      rank: { type: int, default: 4 }
      alpha: { type: float, default: 1.0 })",
                         [] { return std::unique_ptr<Node>(); }, "tests");
  std::string f = write("flowrun: 1\nnodes:\n  m: { type: t_nested }\n");
  GraphSpec g = load_graph(f, {"m.lora.rank=16"}, Registry::global());
  EXPECT_EQ(g.nodes[0].params["lora"]["rank"].as<int>(), 16);
  EXPECT_EQ(g.nodes[0].params["lora"]["alpha"].as<double>(), 1.0);
  std::string e = errors_of(f, {"m.lora.rnk=16"});
  EXPECT_NE(e.find("nodes.m.with.lora.rnk: unknown parameter 'rnk' (did you mean 'rank'?)"), std::string::npos) << e;
}

TEST(Substitution, EnvWithDefaultAndRunKeys) {
  setenv("FLOWRUN_TEST_K", "9", 1);
  unsetenv("FLOWRUN_TEST_UNSET");
  std::string f = write(R"(flowrun: 1
run: { steps: 4, out_dir: "out/${FLOWRUN_TEST_UNSET:-fallback}" }
nodes:
  src: { type: t_source, with: { k: "${FLOWRUN_TEST_K}", sleep_ms: "${run.steps}" } }
)");
  GraphSpec g = load_graph(f, {}, Registry::global());
  EXPECT_EQ(g.nodes[0].params["k"].as<int>(), 9);
  EXPECT_EQ(g.nodes[0].params["sleep_ms"].as<int>(), 4);
  EXPECT_EQ(g.run["out_dir"].as<std::string>(), "out/fallback");
  // Substitution sees overrides.
  GraphSpec g2 = load_graph(f, {"run.steps=6"}, Registry::global());
  EXPECT_EQ(g2.nodes[0].params["sleep_ms"].as<int>(), 6);
}

TEST(Substitution, UnsetVariableIsAnErrorWithPosition) {
  unsetenv("FLOWRUN_TEST_UNSET");
  std::string f = write("flowrun: 1\nnodes:\n  src: { type: t_source, with: { k: \"${FLOWRUN_TEST_UNSET}\" } }\n");
  std::string e = errors_of(f, {});
  EXPECT_NE(e.find(f + ":3:37: nodes.src.with.k: environment variable FLOWRUN_TEST_UNSET is not set"), std::string::npos)
      << e;
}
