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

// t_nested: a node with a map parameter (lora: rank, alpha), registered once.
void register_nested_node() {
  test::register_test_nodes();
  static const bool added = [] {
    Registry::global().add(R"(type: t_nested
doc: nested params
params:
  lora:
    type: map
    fields:
      rank: { type: int, default: 4 }
      alpha: { type: float, default: 1.0 })",
                           [] { return std::unique_ptr<Node>(); }, "tests");
    return true;
  }();
  (void)added;
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
  register_nested_node();
  std::string f = write("flowrun: 1\nnodes:\n  m: { type: t_nested }\n");
  GraphSpec g = load_graph(f, {"m.lora.rank=16"}, Registry::global());
  EXPECT_EQ(g.nodes[0].params["lora"]["rank"].as<int>(), 16);
  EXPECT_EQ(g.nodes[0].params["lora"]["alpha"].as<double>(), 1.0);
  std::string e = errors_of(f, {"m.lora.rnk=16"});
  EXPECT_NE(e.find("nodes.m.with.lora.rnk: unknown parameter 'rnk' (did you mean 'rank'?)"), std::string::npos) << e;
}

// Issue 47: yaml-cpp gives an alias its anchor's very node, so `model.pretrained=X` in
// hydit_v12_lora.yaml also redirected the VAE and both encoders, silently. An anchor writes a
// value twice; an override changes its own path only, and errors in the copies still name the file.
TEST(Overrides, ChangeTheirOwnPathOnlyNotTheOtherPlacesOfAnAnchor) {
  register_nested_node();
  const std::string f = write(R"(flowrun: 1
nodes:
  a: { type: t_source, with: { k: &k 3 } }
  b: { type: t_source, with: { k: *k } }
  m: { type: t_nested, with: { lora: &l { rank: 8 } } }
  n: { type: t_nested, with: { lora: *l } }
)");
  GraphSpec g = load_graph(f, {"a.k=7", "n.lora.alpha=2.5"}, Registry::global());
  EXPECT_EQ(g.nodes[0].params["k"].as<int>(), 7);
  EXPECT_EQ(g.nodes[1].params["k"].as<int>(), 3);
  EXPECT_EQ(g.nodes[2].params["lora"]["alpha"].as<double>(), 1.0);
  EXPECT_EQ(g.nodes[3].params["lora"]["alpha"].as<double>(), 2.5);
  EXPECT_EQ(g.nodes[3].params["lora"]["rank"].as<int>(), 8);

  const std::string bad = write(R"(flowrun: 1
nodes:
  m: { type: t_nested, with: { lora: &l { rank: 8, rnk: 2 } } }
  n: { type: t_nested, with: { lora: *l } }
)");
  const std::string e = errors_of(bad, {});
  EXPECT_NE(e.find(bad + ":3:"), std::string::npos) << e;  // both copies point at the anchor's text
  EXPECT_EQ(e.find("command line"), std::string::npos) << e;
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

// Issue 31, item 11: `${A:-${B}}` with A and B unset gave the text "${B}". A default may hold
// substitutions, expanded only when it is used (as in the shell).
TEST(Substitution, NestedDefaults) {
  setenv("FLOWRUN_TEST_K", "9", 1);
  unsetenv("FLOWRUN_TEST_UNSET");
  unsetenv("FLOWRUN_TEST_UNSET_B");
  std::string f = write(R"(flowrun: 1
run: { out_dir: "${FLOWRUN_TEST_UNSET:-${FLOWRUN_TEST_UNSET_B:-out/${run.steps}}}/x" }
nodes:
  src: { type: t_source, with: { k: "${FLOWRUN_TEST_K:-${FLOWRUN_TEST_UNSET_B}}" } }
)");
  GraphSpec g = load_graph(f, {}, Registry::global());
  EXPECT_EQ(g.run["out_dir"].as<std::string>(), "out/100/x");
  EXPECT_EQ(g.nodes[0].params["k"].as<int>(), 9);  // the default is not used: B need not be set
  std::string e = errors_of(write("flowrun: 1\nnodes:\n  src: { type: t_source, with: { k: \"${FLOWRUN_TEST_UNSET:-${FLOWRUN_TEST_UNSET_B}}\" } }\n"), {});
  EXPECT_NE(e.find(":3:37: nodes.src.with.k: environment variable FLOWRUN_TEST_UNSET_B is not set"), std::string::npos) << e;
  EXPECT_EQ(e.find("variable FLOWRUN_TEST_UNSET "), std::string::npos) << e;  // A has a default
  // A default that is not closed is malformed, used or not.
  e = errors_of(write("flowrun: 1\nnodes:\n  src: { type: t_source, with: { k: \"${FLOWRUN_TEST_K:-${X}\" } }\n"), {});
  EXPECT_NE(e.find("a '${' that is not"), std::string::npos) << e;
}

// Issue 31, item 11: `${...}` in what a substitution brought in stayed as text (a folder named
// "${HOME}"), or not, depending on the order of the file. `${run.KEY}` is the run key after
// its own substitutions, in any order; an environment variable's value is not substituted
// again: a '${' in it is an error.
TEST(Substitution, WhatSubstitutionBringsInIsNeverLeftAsText) {
  unsetenv("FLOWRUN_TEST_UNSET");
  std::string f = write(R"(flowrun: 1
run: { out_dir: "o/${run.trace}", trace: "${FLOWRUN_TEST_UNSET:-t}.json" }
nodes:
  src: { type: t_source }
)");
  GraphSpec g = load_graph(f, {}, Registry::global());
  EXPECT_EQ(g.run["out_dir"].as<std::string>(), "o/t.json");
  EXPECT_EQ(g.run["trace"].as<std::string>(), "t.json");
  // Overrides too: the overridden value is substituted before ${run.KEY} reads it.
  g = load_graph(f, {"run.trace=${FLOWRUN_TEST_UNSET:-u}.json"}, Registry::global());
  EXPECT_EQ(g.run["out_dir"].as<std::string>(), "o/u.json");

  setenv("FLOWRUN_TEST_DOLLAR", "${HOME}/runs", 1);
  std::string e = errors_of(write("flowrun: 1\nrun: { out_dir: \"${FLOWRUN_TEST_DOLLAR}\" }\nnodes:\n  src: { type: t_source }\n"), {});
  unsetenv("FLOWRUN_TEST_DOLLAR");
  EXPECT_NE(e.find(":2:17: run.out_dir: environment variable FLOWRUN_TEST_DOLLAR is '${HOME}/runs', which holds '${'"),
            std::string::npos) << e;

  // Run keys that refer to each other: an error, not a hang.
  e = errors_of(write("flowrun: 1\nrun: { out_dir: \"${run.trace}\", trace: \"${run.out_dir}\" }\nnodes:\n  src: { type: t_source }\n"), {});
  EXPECT_NE(e.find("run.trace: ${run.out_dir}: run keys that refer to each other in a circle (run.out_dir -> run.trace -> "
                   "run.out_dir)"),
            std::string::npos)
      << e;
  e = errors_of(write("flowrun: 1\nrun: { out_dir: \"a${run.out_dir}\" }\nnodes:\n  src: { type: t_source }\n"), {});
  EXPECT_NE(e.find("in a circle (run.out_dir -> run.out_dir)"), std::string::npos) << e;
  // Reached first from a node's parameter (nodes: before run:): the circle alone.
  e = errors_of(write("flowrun: 1\nnodes:\n  src: { type: t_source, with: { k: \"${run.out_dir}\" } }\n"
                      "run: { out_dir: \"${run.trace}\", trace: \"${run.out_dir}\" }\n"),
                {});
  EXPECT_NE(e.find("in a circle (run.out_dir -> run.trace -> run.out_dir)"), std::string::npos) << e;
}

// An anchored value with a substitution, reached through aliases: substituted once, and an
// error in it reported once.
TEST(Substitution, AliasesShareOneResult) {
  setenv("FLOWRUN_TEST_K", "9", 1);
  unsetenv("FLOWRUN_TEST_UNSET");
  std::string f = write(R"(flowrun: 1
run: { steps: 2 }
nodes:
  a: { type: t_source, with: { k: &k "${FLOWRUN_TEST_K}" } }
  b: { type: t_source, with: { k: *k } }
)");
  GraphSpec g = load_graph(f, {}, Registry::global());
  EXPECT_EQ(g.nodes[1].params["k"].as<int>(), 9);
  std::string e = errors_of(write("flowrun: 1\nnodes:\n  a: { type: t_source, with: { k: &k \"${FLOWRUN_TEST_UNSET}\" } }\n"
                                  "  b: { type: t_source, with: { k: *k } }\n"),
                            {});
  size_t reported = 0;
  for (size_t at = e.find("is not set"); at != std::string::npos; at = e.find("is not set", at + 1)) ++reported;
  EXPECT_EQ(reported, 1u) << e;
}
