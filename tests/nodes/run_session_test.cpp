// RunSession (session/run_session.hpp): one run of a checked graph below the CLI, in three calls
// (start, run, close), with the exit codes `flowrun run` returns. The CLI tests (tests/cli) run
// the same through the binary: signals, resume, mpirun.
#include <gtest/gtest.h>

#include <filesystem>

#include "node_test_helpers.hpp"
#include "registry.hpp"
#include "run_session.hpp"
#include "spec.hpp"

namespace flowrun {
namespace {

namespace fs = std::filesystem;

GraphSpec regression(const std::string& out_dir, std::vector<std::string> more = {}) {
  std::vector<std::string> ov = {"run.out_dir=" + out_dir, "run.steps=20", "run.progress=off"};
  ov.insert(ov.end(), more.begin(), more.end());
  return load_graph(std::string(FLOWRUN_SOURCE_DIR) + "/graphs/regression.yaml", ov, Registry::global());
}

// start -> run -> close: the steps run, the metrics and the trace are written, exit code 0.
TEST(RunSession, RunsAGraphFromStartToClose) {
  const std::string dir = test::temp_dir("session");
  const GraphSpec g = regression(dir + "/out", {"run.trace=" + dir + "/trace.json", "run.log_every=5"});
  RunSession s(&g);
  ASSERT_EQ(s.start(), std::nullopt);
  EXPECT_EQ(s.info().device, "cpu");  // resolved (the file says auto)
  EXPECT_EQ(s.info().first_step, 1);
  EXPECT_EQ(s.close(s.run()), 0);
  EXPECT_EQ(test::read_jsonl(dir + "/out/metrics.jsonl").size(), 4u);  // steps 5, 10, 15, 20
  EXPECT_TRUE(fs::exists(dir + "/trace.json"));
}

// Refusals before anything runs are exit code 2, with nothing written: another session holding
// the out_dir, a trace path that is a folder, a file that did not load.
TEST(RunSession, WhatMustBeFixedFirstEndsStartWithCode2) {
  const std::string dir = test::temp_dir("session_refused");
  const GraphSpec g = regression(dir + "/out");
  RunSession first(&g);
  ASSERT_EQ(first.start(), std::nullopt);  // holds OUT_DIR/.flowrun.lock
  RunSession second(&g);
  EXPECT_EQ(second.start(), std::optional<int>(2));
  EXPECT_EQ(second.close(2), 2);  // nothing to write

  fs::create_directories(dir + "/a_folder");
  const GraphSpec traced = regression(dir + "/out2", {"run.trace=" + dir + "/a_folder"});
  RunSession bad_trace(&traced);
  EXPECT_EQ(bad_trace.start(), std::optional<int>(2));
  EXPECT_FALSE(fs::exists(dir + "/out2/metrics.jsonl"));

  RunSession not_loaded(nullptr);
  EXPECT_EQ(not_loaded.start(), std::optional<int>(2));
  EXPECT_EQ(first.close(first.run()), 0);
}

}  // namespace
}  // namespace flowrun
