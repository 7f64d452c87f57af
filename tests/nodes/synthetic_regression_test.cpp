// synthetic_regression: the batch of a step depends only on (seed, step), so a resumed run
// reads exactly the batches it would have read; ranks take disjoint slices of the step's
// global batch, so N ranks with batch B/N read what one process with batch B reads.
#include <gtest/gtest.h>

#include "data/cursor.hpp"
#include "data/synthetic_regression.hpp"
#include "node_test_helpers.hpp"

namespace flowrun {
namespace {

TEST(SyntheticRegression, SameSeedAndStepGiveTheSameBatch) {
  SyntheticRegression a(8, 2, 16, /*seed=*/7, /*noise=*/0.1), b(8, 2, 16, 7, 0.1);
  TensorMap first = a.batch(5, 32);
  // Whatever was drawn before (other steps, in any order) does not matter.
  a.batch(9, 32);
  a.batch(1, 32);
  TensorMap again = a.batch(5, 32);
  TensorMap other_instance = b.batch(5, 32);
  for (const char* k : {"x", "y"}) {
    EXPECT_TRUE(torch::equal(first.at(k), again.at(k))) << k;
    EXPECT_TRUE(torch::equal(first.at(k), other_instance.at(k))) << k;
  }
  EXPECT_EQ(first.at("x").sizes(), (std::vector<int64_t>{32, 8}));
  EXPECT_EQ(first.at("y").sizes(), (std::vector<int64_t>{32, 2}));
  EXPECT_EQ(first.at("x").scalar_type(), torch::kFloat);
}

TEST(SyntheticRegression, OtherStepSeedOrRankGiveOtherBatches) {
  SyntheticRegression a(8, 2, 16, 7, 0.0), b(8, 2, 16, 8, 0.0);
  torch::Tensor x5 = a.batch(5, 32).at("x");
  EXPECT_FALSE(torch::equal(x5, a.batch(6, 32).at("x")));
  EXPECT_FALSE(torch::equal(x5, b.batch(5, 32).at("x")));
  EXPECT_FALSE(torch::equal(a.batch(5, 32, /*rank=*/0, /*world=*/2).at("x"), a.batch(5, 32, 1, 2).at("x")));
  // Another seed is another teacher too.
  EXPECT_FALSE(torch::allclose(a.teacher(x5), b.teacher(x5)));
}

TEST(SyntheticRegression, RanksSliceTheStepsGlobalBatch) {
  // batch(step, 2B, rank 0, world 1) == cat(batch(step, B, 0, 2), batch(step, B, 1, 2)), noise
  // included, for several steps; and 4 ranks of B/2 the same again.
  SyntheticRegression a(5, 3, 8, /*seed=*/21, /*noise=*/0.3);
  const int64_t B = 6;
  for (int64_t step : {1, 2, 17}) {
    const TensorMap whole = a.batch(step, 2 * B);
    const TensorMap r0 = a.batch(step, B, 0, 2), r1 = a.batch(step, B, 1, 2);
    for (const char* k : {"x", "y"}) {
      EXPECT_EQ(r0.at(k).size(0), B) << k;
      EXPECT_TRUE(r0.at(k).is_contiguous()) << k;
      EXPECT_TRUE(torch::equal(torch::cat({r0.at(k), r1.at(k)}), whole.at(k))) << k << " step " << step;
      std::vector<torch::Tensor> quarters;
      for (int r = 0; r < 4; ++r) quarters.push_back(a.batch(step, B / 2, r, 4).at(k));
      EXPECT_TRUE(torch::equal(torch::cat(quarters), whole.at(k))) << k << " step " << step;
    }
  }
  EXPECT_THROW(a.batch(1, B, 2, 2), std::invalid_argument);
  EXPECT_THROW(a.batch(1, B, 0, 0), std::invalid_argument);
}

TEST(SyntheticRegression, TargetsAreTheTeacherPlusNoise) {
  SyntheticRegression clean(4, 3, 8, 1, 0.0), noisy(4, 3, 8, 1, 0.5);
  TensorMap c = clean.batch(3, 2000), n = noisy.batch(3, 2000);
  EXPECT_TRUE(torch::equal(c.at("x"), n.at("x")));
  EXPECT_TRUE(torch::allclose(c.at("y"), clean.teacher(c.at("x"))));
  // The targets are not trivial, and the added noise has the standard deviation asked for.
  EXPECT_GT(c.at("y").std().item<double>(), 0.1);
  EXPECT_NEAR((n.at("y") - c.at("y")).std().item<double>(), 0.5, 0.03);
}

TEST(SyntheticRegressionNode, BatchesInAGraphDependOnlyOnSeedAndStep) {
  // The node with a slow reader and prefetch: what each step sees is the generator's batch
  // for (run.seed, step); the cursor counts the batches drawn.
  auto g = test::load_graph_text(R"(
flowrun: 1
run: { steps: 6, seed: 11, prefetch: 3 }
nodes:
  data: { type: synthetic_regression, with: { in_dim: 3, out_dim: 2, batch: 5, hidden: 4, noise: 0.1, delay_ms: 2 } }
  probe: { type: t_batch_probe, in: { batch: data.batch } }
)");
  {
    std::lock_guard<std::mutex> l(test::BatchProbe::mu());
    test::BatchProbe::seen().clear();
  }
  g->run();
  SyntheticRegression ref(3, 2, 4, /*seed=*/11, 0.1);
  std::lock_guard<std::mutex> l(test::BatchProbe::mu());
  ASSERT_EQ(test::BatchProbe::seen().size(), 6u);
  for (int64_t s = 1; s <= 6; ++s) {
    TensorMap want = ref.batch(s, 5);
    const TensorMap& got = test::BatchProbe::seen().at(s);
    EXPECT_TRUE(torch::equal(got.at("x"), want.at("x"))) << "step " << s;
    EXPECT_TRUE(torch::equal(got.at("y"), want.at("y"))) << "step " << s;
  }
  EXPECT_EQ(g->state<DataCursor>("data", "cursor").batches, 6);
}

TEST(SyntheticRegressionNode, ExplicitSeedOverridesRunSeed) {
  auto g = test::load_graph_text(R"(
flowrun: 1
run: { steps: 2, seed: 11 }
nodes:
  data: { type: synthetic_regression, with: { in_dim: 3, batch: 4, seed: 5 } }
  probe: { type: t_batch_probe, in: { batch: data.batch } }
)");
  {
    std::lock_guard<std::mutex> l(test::BatchProbe::mu());
    test::BatchProbe::seen().clear();
  }
  g->run();
  SyntheticRegression ref(3, 1, 32, /*seed=*/5, 0.0);  // the schema's defaults: out_dim 1, hidden 32
  std::lock_guard<std::mutex> l(test::BatchProbe::mu());
  EXPECT_TRUE(torch::equal(test::BatchProbe::seen().at(2).at("x"), ref.batch(2, 4).at("x")));
  EXPECT_TRUE(torch::equal(test::BatchProbe::seen().at(2).at("y"), ref.batch(2, 4).at("y")));
}

}  // namespace
}  // namespace flowrun
