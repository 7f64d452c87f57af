// graphs/regression.yaml, the demo graph: training reduces the loss, with AdamW and with SGD.
#include <gtest/gtest.h>

#include <numeric>

#include "node_test_helpers.hpp"

namespace flowrun {
namespace {

struct Curve {
  double first = 0, last10 = 0;  // loss at step 1; mean loss of the last 10 steps
};

Curve run_demo(const std::vector<std::string>& overrides) {
  std::vector<std::string> ov = {"run.log_every=1"};
  ov.insert(ov.end(), overrides.begin(), overrides.end());
  test::RunResult r = test::run_graph_text(test::source_file("graphs/regression.yaml"), ov);
  EXPECT_EQ(r.metrics.size(), 300u);
  Curve c;
  if (r.metrics.size() < 10) return c;
  c.first = r.metrics.front()["loss"].get<double>();
  for (size_t i = r.metrics.size() - 10; i < r.metrics.size(); ++i) c.last10 += r.metrics[i]["loss"].get<double>() / 10;
  return c;
}

// Measured on a 2-core CPU (libtorch 1.13, seed 1): the loss goes from 0.42 at step 1 to a
// mean of 0.0021 over steps 291-300 with AdamW (lr 1e-2), and to 0.0037 with SGD (lr 0.1,
// momentum 0.9). Seeds 2-5 end between 0.0017 and 0.0041. The thresholds leave a wide margin
// while still failing for anything that does not learn.
TEST(RegressionGraph, AdamwReducesTheLoss) {
  Curve c = run_demo({});
  EXPECT_GT(c.first, 0.2);
  EXPECT_LT(c.last10, 0.01);
  EXPECT_LT(c.last10, c.first / 20);
}

TEST(RegressionGraph, SgdReducesTheLoss) {
  Curve c = run_demo({"opt.kind=sgd", "opt.lr=0.1"});
  EXPECT_GT(c.first, 0.2);
  EXPECT_LT(c.last10, 0.02);
  EXPECT_LT(c.last10, c.first / 10);
}

TEST(RegressionGraph, OtherSeedsLearnToo) {
  for (const char* seed : {"run.seed=2", "run.seed=5"}) {
    Curve c = run_demo({seed});
    EXPECT_LT(c.last10, c.first / 20) << seed;
  }
}

}  // namespace
}  // namespace flowrun
