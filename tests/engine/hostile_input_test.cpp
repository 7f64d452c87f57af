// Hostile graph files: every one is an error with its line, never a crash or a hang
// (issue 13). Each test names what a user wrote and what flowrun must answer.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>

#include "registry.hpp"
#include "spec.hpp"
#include "support/run_graph.hpp"
#include "support/test_nodes.hpp"

using namespace flowrun;

namespace {

const std::string kNodes = "nodes:\n  src: { type: t_source }\n";

}  // namespace

// Item 1: a scalar where a map belongs was std::terminate (YAML::BadSubscript).
TEST(HostileInput, ScalarWhereAMapBelongs) {
  test::CheckedGraph l = test::check_graph_text("flowrun: 1\nrun: 5\n" + kNodes);
  ASSERT_FALSE(l.ok);
  const auto& d = test::find_diagnostic(l, "expected map");
  EXPECT_EQ(d.path, "run");
  EXPECT_EQ(d.mark.line, 2);
}

// Found by the graph fuzzer (tests/fuzz/corpus/graph/crash-run-scalar-substitution.yaml):
// ${run.KEY} with `run` a scalar escaped the checker as YAML::BadSubscript.
TEST(HostileInput, RunSubstitutionWhenRunIsNotAMap) {
  test::CheckedGraph l = test::check_graph_text("flowrun: 1\nrun: just_a_word\nnodes:\n  src: { type: t_source, with: { k: \"${run.steps}\" } }\n");
  ASSERT_FALSE(l.ok);
  EXPECT_EQ(test::find_diagnostic(l, "expected map").path, "run");
}

// Wrong shapes anywhere in the file: each an error, none a crash.
TEST(HostileInput, WrongShapesEverywhereAreErrors) {
  const std::vector<std::string> files = {
      "flowrun: 1\nrun: [1, 2]\n" + kNodes,
      "flowrun: 1\nrun: { steps: { a: 1 } }\n" + kNodes,
      "flowrun: 1\nrun: { out_dir: [a] }\n" + kNodes,
      "flowrun: 1\nnodes: 5\n",
      "flowrun: 1\nnodes: [a, b]\n",
      "flowrun: 1\nnodes:\n  src: 5\n",
      "flowrun: 1\nnodes:\n  src: { type: [t_source] }\n",
      "flowrun: 1\nnodes:\n  src: { type: t_source, with: 5 }\n",
      "flowrun: 1\nnodes:\n  src: { type: t_source, with: { k: [1] } }\n",
      "flowrun: 1\nnodes:\n  src: { type: t_source, every: [2] }\n",
      "flowrun: 1\nnodes:\n  src: { type: t_source, at: end }\n",
      "flowrun: 1\nnodes:\n  src: { type: t_source, at: [{ a: 1 }] }\n",
      "flowrun: 1\nnodes:\n  src: { type: t_source }\n  a: { type: t_op, in: 5 }\n",
      "flowrun: 1\nnodes:\n  src: { type: t_source }\n  a: { type: t_op, in: { in: { x: 1 } } }\n",
      "flowrun: 1\nplugins: [{ a: 1 }]\n" + kNodes,
      "flowrun: 1\nplugins: lib.so\n" + kNodes,
      "flowrun: [1]\n" + kNodes,
      "flowrun: 1\nname: { a: 1 }\n" + kNodes,
      "5\n",
      "[a, b]\n",
      "",
  };
  for (const auto& f : files) {
    test::CheckedGraph l = test::check_graph_text(f);
    EXPECT_FALSE(l.ok) << f;
    EXPECT_FALSE(l.diags.empty()) << f;
  }
}

// Item 2: an alias inside its own anchor made a node that contains itself (segfault).
TEST(HostileInput, AliasInsideItsOwnAnchor) {
  test::CheckedGraph l = test::check_graph_text("flowrun: 1\nrun: &r { steps: 5, self: *r }\n" + kNodes);
  ASSERT_FALSE(l.ok);
  const auto& d = test::find_diagnostic(l, "would contain itself");
  EXPECT_EQ(d.mark.line, 2);
  EXPECT_GT(d.mark.col, 20);
}

// Item 3: "billion laughs" took ×10 time per level. Refused at once, by expanded size.
TEST(HostileInput, AliasBombIsRefusedQuickly) {
  std::string y = "flowrun: 1\nl0: &l0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i <= 9; ++i) {
    y += "l" + std::to_string(i) + ": &l" + std::to_string(i) + " [";
    for (int k = 0; k < 10; ++k) y += std::string(k ? ", " : "") + "*l" + std::to_string(i - 1);
    y += "]\n";
  }
  y += kNodes;
  const auto t0 = std::chrono::steady_clock::now();
  test::CheckedGraph l = test::check_graph_text(y);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(l.ok);
  test::find_diagnostic(l, "alias bomb");
  EXPECT_LT(s, 2.0);
}

// Aliases within reason still work: an anchor reused as a value.
TEST(HostileInput, PlainAliasesStillWork) {
  test::CheckedGraph l = test::check_graph_text("flowrun: 1\nrun: { steps: &n 4 }\nnodes:\n  src: { type: t_source, with: { k: *n } }\n");
  ASSERT_TRUE(l.ok) << l.all;
  EXPECT_EQ(l.spec.nodes[0].params["k"].as<int>(), 4);
}

// Item 8: duplicate keys validated and the last one won. Reported at the second one, and the
// checker still reports the file's other problems.
TEST(HostileInput, DuplicateKeysAnywhere) {
  test::CheckedGraph l = test::check_graph_text("flowrun: 1\nrun:\n  steps: 5\n  steps: 7\nnodes:\n  src: { type: t_source, with: { k: 1, k: 2 } }\n"
                       "  b: { type: t_source, evry: 3 }\n");
  ASSERT_FALSE(l.ok);
  EXPECT_EQ(test::find_diagnostic(l, "duplicate key 'steps'").mark.line, 4);
  EXPECT_EQ(test::find_diagnostic(l, "duplicate key 'k'").mark.line, 6);
  test::find_diagnostic(l, "unknown parameter 'evry'");
}

// Item 9: `.inf` validated (and the run failed at step 2). NaN and infinity are refused.
TEST(HostileInput, InfiniteAndNanFloatsAreRefused) {
  for (const std::string v : {".inf", "-.inf", ".Inf", ".nan", "1e999"}) {
    test::CheckedGraph l = test::check_graph_text("flowrun: 1\nrun: { steps: 5, comm_timeout_s: " + v + " }\n" + kNodes);
    ASSERT_FALSE(l.ok) << v;
    EXPECT_EQ(test::find_diagnostic(l, "expected float").path, "run.comm_timeout_s") << v;
  }
  EXPECT_TRUE(test::check_graph_text("flowrun: 1\nrun: { steps: 5, comm_timeout_s: 1e3 }\n" + kNodes).ok);
}

// A too-deep file was "bad file"; now it says what is wrong and where, at any depth.
TEST(HostileInput, TooDeep) {
  for (int depth : {100, 100000}) {
    test::CheckedGraph l = test::check_graph_text("flowrun: 1\nx: " + std::string(depth, '[') + std::string(depth, ']') + "\n" + kNodes);
    ASSERT_FALSE(l.ok) << depth;
    EXPECT_EQ(test::find_diagnostic(l, "levels deep").mark.line, 2) << depth;
  }
}

// A second YAML document was ignored silently.
TEST(HostileInput, SecondDocument) {
  test::CheckedGraph l = test::check_graph_text("flowrun: 1\n" + kNodes + "---\nflowrun: 1\n");
  ASSERT_FALSE(l.ok);
  EXPECT_EQ(test::find_diagnostic(l, "second YAML document").mark.line, 4);
}

// A malformed ${... was left in the value silently.
TEST(HostileInput, MalformedSubstitution) {
  for (const std::string v : {"${HOME", "a${1x}b", "${run.steps"}) {
    test::CheckedGraph l = test::check_graph_text("flowrun: 1\nrun: { out_dir: \"" + v + "\" }\n" + kNodes);
    ASSERT_FALSE(l.ok) << v;
    EXPECT_EQ(test::find_diagnostic(l, "a '${' that is not").path, "run.out_dir") << v;
  }
  test::CheckedGraph ok = test::check_graph_text("flowrun: 1\nrun: { out_dir: \"x/${run.steps}/${NOT_SET_ANYWHERE:-d}\" }\n" + kNodes);
  ASSERT_TRUE(ok.ok) << ok.all;
  EXPECT_EQ(ok.spec.run["out_dir"].as<std::string>(), "x/100/d");
}

// Keys are names: a list, a map or an alias as a key is refused.
TEST(HostileInput, KeysThatAreNotNames) {
  for (const std::string bad : {"? [a, b]\n: 1\n", "? { a: 1 }\n: 1\n", "a: &k x\n*k : 1\n"}) {
    test::CheckedGraph l = test::check_graph_text("flowrun: 1\n" + bad + kNodes);
    ASSERT_FALSE(l.ok) << bad;
    test::find_diagnostic(l, "a map key is");
  }
}

// Override values go through the same loader.
TEST(HostileInput, OverrideValues) {
  test::CheckedGraph l = test::check_graph_text("flowrun: 1\n" + kNodes, {"src.k=&a [*a]"});
  ASSERT_FALSE(l.ok);
  test::find_diagnostic(l, "would contain itself");
  test::CheckedGraph d = test::check_graph_text("flowrun: 1\n" + kNodes, {"src.k={a: 1, a: 2}"});
  ASSERT_FALSE(d.ok);
  test::find_diagnostic(d, "duplicate key 'a'");
}

// The graph file itself: a folder, a device, a missing file.
TEST(HostileInput, GraphFileThatIsNotAFile) {
  for (const auto& [path, says] : std::vector<std::pair<std::string, std::string>>{
           {test::temp_dir("hostile_dir"), "it is a folder"},
           {"/dev/zero", "not a regular file"},
           {"/nonexistent/g.yaml", "no such file"}}) {
    try {
      load_graph(path, {}, Registry::global());
      ADD_FAILURE() << path;
    } catch (const GraphError& e) {
      EXPECT_NE(e.diagnostics().str().find(says), std::string::npos) << e.diagnostics().str();
    }
  }
}

// Issue 31, item 11: the depth limit counted an alias as one level. 110 anchors, each a list
// 60 deep holding the previous one, passed it and expanded to 6,600 levels: substitution
// overflowed the stack (exit 139 in `flowrun validate` and in a run). The depth is now
// measured with aliases expanded. 175 anchors (10,500 levels) is about the longest chain
// under the limit of 1,000,000 nodes.
TEST(HostileInput, AliasChainTooDeepOnceExpanded) {
  for (int anchors : {110, 175}) {
    std::string y = "flowrun: 1\n";
    for (int i = 0; i < anchors; ++i)
      y += "a" + std::to_string(i) + ": &a" + std::to_string(i) + " " + std::string(60, '[') +
           (i ? "*a" + std::to_string(i - 1) : std::string("x")) + std::string(60, ']') + "\n";
    y += "nodes:\n  src: { type: t_source, with: { k: \"${run.steps}\" } }\n";
    const auto t0 = std::chrono::steady_clock::now();
    test::CheckedGraph l = test::check_graph_text(y);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_FALSE(l.ok) << anchors;
    const auto& d = test::find_diagnostic(l, "levels deep once its aliases are expanded");
    EXPECT_EQ(d.path.rfind("a", 0), 0u) << d.path;  // under the key that holds the chain
    EXPECT_GE(d.mark.line, 2) << d.str();
    EXPECT_LT(s, 2.0) << anchors;
  }
  // The same chain as an override's value.
  std::string v = "[";
  for (int i = 0; i < 110; ++i)
    v += std::string(i ? ", " : "") + "&a" + std::to_string(i) + " " + std::string(60, '[') +
         (i ? "*a" + std::to_string(i - 1) : std::string("x")) + std::string(60, ']');
  v += "]";
  test::CheckedGraph o = test::check_graph_text("flowrun: 1\n" + kNodes, {"src.k=" + v});
  ASSERT_FALSE(o.ok);
  EXPECT_EQ(test::find_diagnostic(o, "levels deep once its aliases are expanded").mark.file, "command line");
  // Within the limit, aliases of nested anchors still load.
  test::CheckedGraph ok = test::check_graph_text("flowrun: 1\na: &a [[[x]]]\nb: &b [[*a, *a]]\nnodes:\n  src: { type: t_source, with: { k: 1 } }\n");
  EXPECT_EQ(ok.all.find("levels deep"), std::string::npos) << ok.all;
}

// Issue 31, item 11: nothing bounded what substitution writes: a 1.4 MB file of ${run.KEY}
// references to a long run key asked for about 20 GB (std::bad_alloc). Here each run key
// repeats the one before: 1 KB, 1 MB, 100 MB. Refused at 16 MiB, at the key that passes it.
TEST(HostileInput, SubstitutionOutputIsBounded) {
  std::string b, c;
  for (int i = 0; i < 1000; ++i) b += "${run.a}";
  for (int i = 0; i < 100; ++i) c += "${run.b}";
  const auto t0 = std::chrono::steady_clock::now();
  test::CheckedGraph l = test::check_graph_text("flowrun: 1\nrun:\n  a: " + std::string(1000, 'x') + "\n  b: \"" + b + "\"\n  c: \"" + c + "\"\n" + kNodes);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(l.ok);
  const auto& d = test::find_diagnostic(l, "substitution makes more than 16 MiB of text");
  EXPECT_EQ(d.path, "run.c");
  EXPECT_EQ(d.mark.line, 5);
  EXPECT_LT(s, 2.0);
}
