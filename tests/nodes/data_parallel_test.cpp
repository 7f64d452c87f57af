// What the built-in nodes do as one rank of several, checked in one process: the graph is set
// up with RunInfo rank/world of a larger world while the comm world is this process alone (so
// every collective completes at once, as if the other ranks held the same numbers).
//   - synthetic_regression emits this rank's slice of the step's global batch;
//   - checkpoint writes (and copies) nothing on a rank other than 0;
//   - metrics runs on every rank, but only rank 0 writes metrics.jsonl;
//   - evaluator runs with more than one rank (it used to refuse), each scoring its shard.
#include <gtest/gtest.h>

#include <filesystem>

#include "comm.hpp"
#include "data/synthetic_regression.hpp"
#include "eval/evaluator.hpp"
#include "node_test_helpers.hpp"
#include "train/losses.hpp"

namespace flowrun {
namespace {

namespace fs = std::filesystem;

const char* kTraining = R"(
flowrun: 1
run: { steps: 6, seed: 9, log_every: 2 }
nodes:
  data: { type: synthetic_regression, with: { in_dim: 4, batch: 8, noise: 0.1 } }
  probe: { type: t_batch_probe, in: { batch: data.batch } }
  model: { type: mlp, with: { in_dim: 4, hidden: 8, layers: 1 } }
  loss: { type: mse_loss }
  fb: { type: forward_backward, in: { batch: data.batch, objective: loss.objective, model: model.params } }
  opt: { type: optimizer, in: { grads: fb.grads, model: model.params }, with: { lr: 0.01 } }
  log: { type: metrics, in: { loss: fb.loss, lr: opt.lr } }
  ckpt: { type: checkpoint, every: 3, in: { state: [model.params, opt.state, data.cursor] } }
)";

TEST(DataParallel, RankOneReadsItsSliceAndWritesNoMetrics) {
  ASSERT_EQ(comm::size(), 1);
  auto g = test::load_graph_at(kTraining, 1, 2);
  const auto seen = test::run_and_probe(*g);
  // Rows [8, 16) of each step's global batch of 16.
  SyntheticRegression ref(4, 1, 32, /*seed=*/9, 0.1);
  ASSERT_EQ(seen.size(), 6u);
  for (const auto& [step, batch] : seen) {
    const TensorMap whole = ref.batch(step, 16);
    EXPECT_TRUE(torch::equal(batch.at("x"), whole.at("x").narrow(0, 8, 8))) << step;
    EXPECT_TRUE(torch::equal(batch.at("y"), whole.at("y").narrow(0, 8, 8))) << step;
  }
  // No metrics file: rank 0 writes it. (Checkpoints: every rank writes its own pieces; tests/mpi
  // ckpt_reshard runs the ranks together.)
  EXPECT_FALSE(fs::exists(g->out_dir + "/metrics.jsonl"));
}

TEST(DataParallel, RankZeroWritesMetricsAndCheckpointsAsOneProcessDoes) {
  auto g = test::load_graph_at(kTraining, 0, 2);
  g->run();
  const auto m = g->metrics();
  ASSERT_EQ(m.size(), 3u);  // steps 2, 4, 6
  EXPECT_EQ(m[2]["step"].get<int64_t>(), 6);
  EXPECT_TRUE(m[2]["loss"].is_number_float());
  EXPECT_DOUBLE_EQ(m[2]["lr"].get<double>(), 0.01);
  EXPECT_TRUE(fs::exists(g->out_dir + "/checkpoints/step_00000006/manifest.json"));
  EXPECT_TRUE(fs::exists(g->out_dir + "/checkpoints/latest"));
}

// A Dataset of synthetic_regression rows, sharded as the node shards: batch i is the global
// batch of step i + 1, rank r's slice of it.
class RegressionDataset : public Dataset {
 public:
  std::vector<std::string> splits() const override { return {"val"}; }
  int64_t num_batches(const std::string&, int64_t, int, int) const override { return 5; }
  TensorMap batch(const std::string&, int64_t index, int64_t batch, int rank, int world) const override {
    return gen_.batch(index + 1, batch, rank, world);
  }

 private:
  SyntheticRegression gen_{4, 1, 8, /*seed=*/13, /*noise=*/0.2};
};

class RegressionDataNode : public Node {
 public:
  void setup(SetupContext& c) override {
    c.own_state("dataset", std::shared_ptr<Dataset>(std::make_shared<RegressionDataset>()));
  }
  void run(StepContext&) override {}
};

TEST(DataParallel, EvaluatorRanksScoreTheirShards) {
  static std::once_flag once;
  std::call_once(once, [] {
    Registry::global().add(R"(type: t_dp_regression_dataset
doc: synthetic_regression rows as a Dataset
outputs: { dataset: { kind: state, access: none, type: dataset, doc: the dataset } })",
                           [] { return std::make_unique<RegressionDataNode>(); }, "tests");
  });
  auto graph = [](int64_t batch) {
    return R"(
flowrun: 1
run: { steps: 1, seed: 2 }
nodes:
  data: { type: t_dp_regression_dataset }
  model: { type: mlp, with: { in_dim: 4, hidden: 8, layers: 1 } }
  loss: { type: mse_loss }
  eval: { type: evaluator, in: { objective: loss.objective, model: model.params, data: data.dataset }, with: { batches: 3, batch: )" +
           std::to_string(batch) + R"( } }
  log: { type: metrics, in: { val_loss: eval.loss } }
)";
  };
  auto rank0_loss = [&](int world, int64_t batch) {
    auto g = test::load_graph_at(graph(batch), 0, world);
    g->run();
    return g->metrics().at(0)["val_loss"].get<double>();
  };
  // Here the all-reduce has no other rank to add, so rank 0 of 2 outputs its shard's mean;
  // with rank 1's (same number of rows) it makes one process's mean over both shards.
  const double whole = rank0_loss(1, 8);
  auto g1 = test::load_graph_at(graph(4), 1, 2);  // rank 1: no refusal, runs, writes nothing
  g1->run();
  EXPECT_FALSE(fs::exists(g1->out_dir + "/metrics.jsonl"));
  const double r0 = rank0_loss(2, 4);
  EvalOptions o;
  o.batches = 3, o.batch = 4, o.rank = 1, o.world = 2;
  RegressionDataset data;
  const double r1 = evaluate(g1->state<ModelState>("model", "params"), data, MseLoss(), o).loss;
  EXPECT_NE(r0, whole);
  EXPECT_NEAR((r0 + r1) / 2, whole, 1e-5);
}

}  // namespace
}  // namespace flowrun
