// Checker: one test per kind of error, asserting the message and its position.
#include <gtest/gtest.h>

#include <fstream>

#include "registry.hpp"
#include "spec.hpp"
#include "support/run_graph.hpp"
#include "support/test_nodes.hpp"

using namespace flowrun;

namespace {

const char* kGood = R"(flowrun: 1
name: good
run: { steps: 5 }
nodes:
  src: { type: t_source, with: { k: 3 } }
  cell: { type: t_cell }
  a: { type: t_op, in: { in: [src.out] } }
  w: { type: t_write, in: { s: cell.cell, in: [a.out] } }
  r: { type: t_read, every: 2, in: { s: cell.cell } }
)";

}  // namespace

TEST(Check, GoodFileBuildsSpecWithDefaults) {
  test::CheckedGraph l = test::check_graph_text(kGood);
  ASSERT_TRUE(l.ok);
  EXPECT_EQ(l.spec.name, "good");
  ASSERT_EQ(l.spec.nodes.size(), 5u);
  EXPECT_EQ(l.spec.nodes[0].params["k"].as<int>(), 3);
  EXPECT_EQ(l.spec.nodes[0].params["sleep_ms"].as<int>(), 0);  // default filled
  EXPECT_EQ(l.spec.run["prefetch"].as<int>(), 2);
  EXPECT_EQ(l.spec.run["out_dir"].as<std::string>(), "runs/good");
  EXPECT_EQ(l.spec.nodes[4].schedule.every, 2);
  EXPECT_EQ(l.spec.nodes[3].inputs[0].refs[0].node_index, 1);
}

// The run: section also comes typed (GraphSpec::settings): the file's values, the schema's
// defaults for the rest, out_dir filled in; what the CLI, the executor and the nodes read.
TEST(RunSettings, AreTheCheckedRunSectionTyped) {
  test::CheckedGraph l = test::check_graph_text(kGood, {"run.threads=3", "run.resume=auto", "run.precision=bf16",
                                                        "run.comm_timeout_s=2.5", "run.parallel.tp=4"});
  ASSERT_TRUE(l.ok);
  const RunSettings& s = l.spec.settings;
  EXPECT_EQ(s.steps, 5);
  EXPECT_EQ(s.threads, 3);
  EXPECT_EQ(s.resume, "auto");
  EXPECT_EQ(s.precision, "bf16");
  EXPECT_DOUBLE_EQ(s.comm_timeout_s, 2.5);
  EXPECT_DOUBLE_EQ(s.heartbeat_timeout_s, 10.0);
  EXPECT_EQ(s.prefetch, 2);  // schemas/graph.yaml's defaults
  EXPECT_EQ(s.device, "auto");
  EXPECT_EQ(s.progress, "auto");
  EXPECT_TRUE(s.compute_thread);
  EXPECT_EQ(s.out_dir, "runs/good");
  EXPECT_EQ(s.parallel.tp, 4);  // a nested map, its other key defaulted
  EXPECT_EQ(s.parallel.pp, 1);
}

// Every key of the schema's run group has its field: a key added to schemas/graph.yaml and not
// to RunSettings is refused by name (here one added by hand to a checked section).
TEST(RunSettings, AKeyWithoutAFieldIsRefusedByName) {
  test::CheckedGraph l = test::check_graph_text(kGood);
  ASSERT_TRUE(l.ok);
  EXPECT_NO_THROW(run_settings(l.spec.run));
  YAML::Node run = YAML::Clone(l.spec.run);
  run["new_setting"] = 1;
  try {
    run_settings(run);
    ADD_FAILURE() << "no error";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("run.new_setting is in schemas/graph.yaml but not in RunSettings"),
              std::string::npos) << e.what();
  }
  run = YAML::Clone(l.spec.run);
  run.remove("seed");
  EXPECT_THROW(run_settings(run), std::logic_error);
}

TEST(Check, MisspeltTopKeyAndRunKey) {
  test::CheckedGraph l = test::check_graph_text("flowrun: 1\nrun: { stesp: 5 }\nnodz: {}\nnodes:\n  s: { type: t_source }\n");
  ASSERT_FALSE(l.ok);
  const auto& d = test::find_diagnostic(l, "unknown parameter 'stesp'");
  EXPECT_NE(d.message.find("did you mean 'steps'"), std::string::npos);
  EXPECT_EQ(d.mark.line, 2);
  EXPECT_EQ(d.mark.col, 8);
  EXPECT_EQ(d.path, "run.stesp");
  const auto& d2 = test::find_diagnostic(l, "unknown parameter 'nodz'");
  EXPECT_NE(d2.message.find("did you mean 'nodes'"), std::string::npos);
  EXPECT_EQ(d2.mark.line, 3);
  EXPECT_EQ(l.diags.size(), 2u);  // all errors at once
}

TEST(Check, UnknownNodeTypeListsRegisteredTypes) {
  test::CheckedGraph l = test::check_graph_text("flowrun: 1\nnodes:\n  s: { type: t_sorce }\n");
  ASSERT_FALSE(l.ok);
  const auto& d = test::find_diagnostic(l, "unknown node type 't_sorce'");
  EXPECT_NE(d.message.find("did you mean 't_source'"), std::string::npos);
  EXPECT_NE(d.message.find("registered: "), std::string::npos);
  EXPECT_EQ(d.path, "nodes.s.type");
  EXPECT_EQ(d.mark.line, 3);
  EXPECT_EQ(d.mark.col, 14);
}

TEST(Check, WrongParamTypeAndRange) {
  test::CheckedGraph l = test::check_graph_text("flowrun: 1\nnodes:\n  s: { type: t_source, with: { k: abc, sleep_ms: -4 } }\n");
  ASSERT_FALSE(l.ok);
  const auto& d = test::find_diagnostic(l, "expected int, got 'abc'");
  EXPECT_EQ(d.path, "nodes.s.with.k");
  EXPECT_EQ(d.mark.line, 3);
  const auto& r = test::find_diagnostic(l, "out of range");
  EXPECT_EQ(r.path, "nodes.s.with.sleep_ms");
}

TEST(Check, UnknownParamDidYouMean) {
  test::CheckedGraph l = test::check_graph_text("flowrun: 1\nnodes:\n  s: { type: t_source, with: { sleep_mss: 1 } }\n");
  ASSERT_FALSE(l.ok);
  const auto& d = test::find_diagnostic(l, "unknown parameter 'sleep_mss'");
  EXPECT_NE(d.message.find("did you mean 'sleep_ms'"), std::string::npos);
}

TEST(Check, InputMustNameEarlierNode) {
  test::CheckedGraph l = test::check_graph_text(R"(flowrun: 1
nodes:
  a: { type: t_op, in: { in: [src.out] } }
  src: { type: t_source }
)");
  ASSERT_FALSE(l.ok);
  const auto& d = test::find_diagnostic(l, "declared after 'a'");
  EXPECT_NE(d.message.find("file order is program order"), std::string::npos);
  EXPECT_EQ(d.mark.line, 3);
}

TEST(Check, UnknownNodeAndPortDidYouMean) {
  test::CheckedGraph l = test::check_graph_text(R"(flowrun: 1
nodes:
  src: { type: t_source }
  a: { type: t_op, in: { in: [srx.out] } }
  b: { type: t_op, in: { in: [src.outt] } }
  c: { type: t_op, in: { inn: [src.out] } }
)");
  ASSERT_FALSE(l.ok);
  EXPECT_NE(test::find_diagnostic(l, "no node 'srx'").message.find("did you mean 'src'"), std::string::npos);
  EXPECT_NE(test::find_diagnostic(l, "has no output 'outt'").message.find("did you mean 'out'"), std::string::npos);
  EXPECT_NE(test::find_diagnostic(l, "has no input 'inn'").message.find("did you mean 'in'"), std::string::npos);
  EXPECT_EQ(l.diags.size(), 3u);
}

TEST(Check, PortKindAndTypeMismatch) {
  test::CheckedGraph l = test::check_graph_text(R"(flowrun: 1
nodes:
  src: { type: t_source }
  cell: { type: t_cell }
  w: { type: t_write, in: { s: src.out } }
  x: { type: t_op, in: { in: [cell.cell] } }
)");
  ASSERT_FALSE(l.ok);
  EXPECT_EQ(test::find_diagnostic(l, "src.out is a value port but input 's'").path, "nodes.w.in.s");
  test::find_diagnostic(l, "cell.cell is a state port but input 'in'");
}

TEST(Check, MissingRequiredInput) {
  test::CheckedGraph l = test::check_graph_text("flowrun: 1\nnodes:\n  w: { type: t_write }\n");
  ASSERT_FALSE(l.ok);
  const auto& d = test::find_diagnostic(l, "missing input 's'");
  EXPECT_EQ(d.path, "nodes.w.in.s");
  EXPECT_EQ(d.mark.line, 3);
}

TEST(Check, PeriodicProducerNeedsPeriodicConsumer) {
  test::CheckedGraph l = test::check_graph_text(R"(flowrun: 1
nodes:
  src: { type: t_source, every: 2 }
  a: { type: t_op, in: { in: [src.out] } }
  b: { type: t_op, every: 4, in: { in: [src.out] } }
  c: { type: t_op, every: 3, in: { in: [src.out] } }
)");
  ASSERT_FALSE(l.ok);
  EXPECT_EQ(l.diags.size(), 2u);  // a and c; b (every 4 within every 2) is fine
  EXPECT_EQ(test::find_diagnostic(l, "produced only every 2, but 'a' runs every step").path, "nodes.a.in.in");
}

TEST(Check, ListToSinglePortAndBadRef) {
  test::CheckedGraph l = test::check_graph_text(R"(flowrun: 1
nodes:
  cell: { type: t_cell }
  w: { type: t_write, in: { s: [cell.cell] } }
  r: { type: t_read, in: { s: cellcell } }
)");
  ASSERT_FALSE(l.ok);
  test::find_diagnostic(l, "takes one NODE.PORT, not a list");
  test::find_diagnostic(l, "'cellcell' is not NODE.PORT");
}

TEST(Check, DuplicateNodeAndBadNodeKey) {
  test::CheckedGraph l = test::check_graph_text(R"(flowrun: 1
nodes:
  a: { type: t_source }
  a: { type: t_source }
  b: { type: t_source, evry: 3 }
)");
  ASSERT_FALSE(l.ok);
  EXPECT_EQ(test::find_diagnostic(l, "duplicate key 'a'").mark.line, 4);
  EXPECT_NE(test::find_diagnostic(l, "unknown parameter 'evry'").message.find("did you mean 'every'"), std::string::npos);
}

TEST(Check, MissingVersionAndSyntaxError) {
  test::CheckedGraph l = test::check_graph_text("nodes:\n  a: { type: t_source }\n");
  ASSERT_FALSE(l.ok);
  EXPECT_EQ(test::find_diagnostic(l, "missing required parameter 'flowrun'").path, "flowrun");
  test::CheckedGraph s = test::check_graph_text("flowrun: 1\nnodes:\n  a: { type: t_source\n");
  ASSERT_FALSE(s.ok);
  const auto& d = test::find_diagnostic(s, "YAML syntax error");
  EXPECT_GT(d.mark.line, 0);
}

TEST(Check, MissingFileIsOneError) {
  try {
    load_graph("/nonexistent/g.yaml", {}, Registry::global());
    FAIL();
  } catch (const GraphError& e) {
    ASSERT_EQ(e.diagnostics().size(), 1u);
    EXPECT_NE(e.diagnostics().list()[0].str().find("/nonexistent/g.yaml: cannot read the graph file: no such file"),
              std::string::npos);
  }
}

TEST(Check, DiagnosticFormat) {
  test::CheckedGraph l = test::check_graph_text("flowrun: 1\nrun: { stesp: 5 }\nnodes:\n  s: { type: t_source }\n");
  ASSERT_EQ(l.diags.size(), 1u);
  EXPECT_EQ(l.diags[0].str(), l.file + ":2:8: run.stesp: unknown parameter 'stesp' (did you mean 'steps'?); known: " +
                                  "steps, seed, device, precision, prefetch, out_dir, log_every, threads, workers, compute_thread, cpu_gemm, cuda_graph, trace, profile, progress, stop_grace_s, resume, comm_timeout_s, heartbeat_timeout_s, parallel");
}

TEST(Check, StreamNamesAreFreeNamesAndDefaultIsTheDefaultStream) {
  test::CheckedGraph ok = test::check_graph_text(R"(flowrun: 1
nodes:
  src: { type: t_source, stream: text_encoders }
  a: { type: t_op, stream: default, in: { in: [src.out] } }
)");
  ASSERT_TRUE(ok.ok);
  EXPECT_EQ(ok.spec.nodes[0].stream, "text_encoders");
  EXPECT_EQ(ok.spec.nodes[1].stream, "");  // "default" and no key are the same stream
  test::CheckedGraph bad = test::check_graph_text(R"(flowrun: 1
nodes:
  src: { type: t_source, stream: "io.1" }
)");
  ASSERT_FALSE(bad.ok);
  const Diagnostic& d = test::find_diagnostic(bad, "a stream name uses letters");
  EXPECT_EQ(d.path, "nodes.src.stream");
  EXPECT_EQ(d.mark.line, 3);
}

TEST(Check, RunDeviceIsAutoCpuCudaOrCudaN) {
  for (const char* good : {"auto", "cpu", "cuda", "cuda:0", "cuda:7"})
    EXPECT_TRUE(test::check_graph_text(kGood, {std::string("run.device=") + good}).ok) << good;
  // "cuda:" is YAML for a map { cuda: null }: a type error, reported as such.
  EXPECT_EQ(test::find_diagnostic(test::check_graph_text(kGood, {"run.device=cuda:"}), "expected string, got (a map)").path, "run.device");
  for (const char* bad : {"gpu", "cuda:x", "cuda:-1", "CUDA"}) {
    test::CheckedGraph l = test::check_graph_text(kGood, {std::string("run.device=") + bad});
    ASSERT_FALSE(l.ok) << bad;
    const Diagnostic& d = test::find_diagnostic(l, "is not a device: use auto, cpu, cuda or cuda:N");
    EXPECT_EQ(d.path, "run.device") << bad;
  }
  test::CheckedGraph in_file = test::check_graph_text("flowrun: 1\nrun:\n  steps: 2\n  device: tpu\nnodes:\n  src: { type: t_source }\n");
  ASSERT_FALSE(in_file.ok);
  EXPECT_EQ(test::find_diagnostic(in_file, "'tpu' is not a device").mark.line, 4);
}

TEST(Check, AtStopNodesTakeStateInputsOnly) {
  test::CheckedGraph l = test::check_graph_text(R"(flowrun: 1
nodes:
  src: { type: t_source }
  cell: { type: t_cell }
  ok: { type: t_read, at: [end, stop], in: { s: cell.cell } }
  bad: { type: t_read, at: [stop], in: { s: cell.cell, in: [src.out] } }
)");
  ASSERT_FALSE(l.ok);
  const Diagnostic& d = test::find_diagnostic(l, "runs at stop, after the last step's values are freed");
  EXPECT_EQ(d.path, "nodes.bad.in.in");
  EXPECT_EQ(d.mark.line, 6);
  EXPECT_EQ(l.diags.size(), 1u);
}
