// metrics: one JSON line per logged step (every run.log_every steps and the last step) with
// step, time, steps_per_s and every connected input by its port name.
#include <gtest/gtest.h>

#include <filesystem>

#include "executor.hpp"
#include "data_test_helpers.hpp"
#include "node_test_helpers.hpp"

namespace flowrun {
namespace {

const char* kTraining = R"(
flowrun: 1
run: { steps: 25, seed: 1, log_every: 10 }
nodes:
  data: { type: synthetic_regression, with: { in_dim: 4, batch: 16 } }
  model: { type: mlp, with: { in_dim: 4, hidden: 8, layers: 1 } }
  loss: { type: mse_loss }
  fb: { type: forward_backward, in: { batch: data.batch, objective: loss.objective, model: model.params } }
  opt: { type: optimizer, in: { grads: fb.grads, model: model.params }, with: { lr: 0.01 } }
  log: { type: metrics, in: { loss: fb.loss, lr: opt.lr, grad_norm: opt.grad_norm } }
)";

TEST(Metrics, OneLinePerLoggedStepWithEveryPort) {
  test::RunResult r = test::run_graph_text(kTraining);
  ASSERT_EQ(r.metrics.size(), 3u);  // steps 10, 20 and the last, 25
  const int64_t want_steps[] = {10, 20, 25};
  double last_time = 0;
  for (size_t i = 0; i < r.metrics.size(); ++i) {
    const nlohmann::json& j = r.metrics[i];
    EXPECT_EQ(j["step"].get<int64_t>(), want_steps[i]);
    for (const char* k : {"time", "steps_per_s", "loss", "lr", "grad_norm"}) {
      ASSERT_TRUE(j.contains(k)) << k << " in " << j.dump();
      EXPECT_TRUE(j[k].is_number()) << k << " in " << j.dump();
    }
    EXPECT_GE(j["time"].get<double>(), last_time);
    last_time = j["time"].get<double>();
    EXPECT_GT(j["steps_per_s"].get<double>(), 0);
    EXPECT_GT(j["loss"].get<double>(), 0);
    EXPECT_DOUBLE_EQ(j["lr"].get<double>(), 0.01);
    EXPECT_GT(j["grad_norm"].get<double>(), 0);
  }
}

TEST(Metrics, AppendsAndCreatesOutDir) {
  const std::string dir = test::temp_dir("metrics") + "/a/b";
  test::run_graph_text(kTraining, {"run.out_dir=" + dir, "run.steps=10"});
  test::run_graph_text(kTraining, {"run.out_dir=" + dir, "run.steps=10"});
  auto lines = test::read_jsonl(dir + "/metrics.jsonl");
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["step"], 10);
  EXPECT_EQ(lines[1]["step"], 10);
  // Same seeds, same run: the same loss.
  EXPECT_EQ(lines[0]["loss"], lines[1]["loss"]);
}

TEST(Metrics, LogsScalarsOfEveryKind) {
  test::register_node_test_types();
  test::RunResult r = test::run_graph_text(R"(
flowrun: 1
run: { steps: 3, log_every: 1 }
nodes:
  s: { type: t_scalars }
  log: { type: metrics, in: { d: s.d, i: s.i, t: s.t, ti: s.ti } }
)");
  ASSERT_EQ(r.metrics.size(), 3u);
  const nlohmann::json& j = r.metrics[1];  // step 2
  EXPECT_EQ(j["step"], 2);
  EXPECT_DOUBLE_EQ(j["d"].get<double>(), 3.0);
  EXPECT_TRUE(j["i"].is_number_integer());
  EXPECT_EQ(j["i"].get<int64_t>(), 2);
  EXPECT_DOUBLE_EQ(j["t"].get<double>(), 0.5);
  EXPECT_TRUE(j["ti"].is_number_integer());
  EXPECT_EQ(j["ti"].get<int64_t>(), 20);
}

// A set of named scalars (a score per prompt) is one field per entry, PORT/NAME, in order;
// the names may hold spaces and slashes.
TEST(Metrics, LogsNamedScalarsAsPortSlashName) {
  test::register_node_test_types();
  test::RunResult r = test::run_graph_text(R"(
flowrun: 1
run: { steps: 2, log_every: 1 }
nodes:
  s: { type: t_scalars }
  log: { type: metrics, in: { d: s.d, per: s.n } }
)");
  ASSERT_EQ(r.metrics.size(), 2u);
  const nlohmann::json& j = r.metrics[1];  // step 2
  EXPECT_DOUBLE_EQ(j["per/first"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(j["per/a b/c"].get<double>(), -2.0);
  EXPECT_FALSE(j.contains("per")) << j.dump();
  // In the file, in input order, the entries in their own order.
  const std::string line = test::read_text(r.out_dir + "/metrics.jsonl");
  const size_t d = line.find("\"d\""), first = line.find("\"per/first\""), abc = line.find("\"per/a b/c\"");
  ASSERT_NE(abc, std::string::npos) << line;
  EXPECT_LT(d, first);
  EXPECT_LT(first, abc);
}

TEST(Metrics, RefusesANonScalarTensor) {
  test::register_node_test_types();
  try {
    test::run_graph_text(R"(
flowrun: 1
run: { steps: 2, log_every: 1 }
nodes:
  s: { type: t_scalars }
  log: { type: metrics, in: { v: s.v } }
)");
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("scalar"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace flowrun
