// synthetic_regression: a seeded data source for tests, demos and benchmarks.
// Schema: schemas/synthetic_regression.yaml. Test: tests/nodes/synthetic_regression_test.cpp.
#include "data/synthetic_regression.hpp"

#include <chrono>
#include <cmath>
#include <thread>

#include "common/seed.hpp"
#include "data/cursor.hpp"
#include "registry.hpp"

namespace flowrun {

SyntheticRegression::SyntheticRegression(int64_t in_dim, int64_t out_dim, int64_t hidden, uint64_t seed, double noise)
    : in_dim_(in_dim), out_dim_(out_dim), seed_(seed), noise_(noise) {
  torch::NoGradGuard no_grad;
  at::Generator g = make_cpu_generator(mix_seed({seed, kSeedTagTeacher}));
  // Scaled so pre-activations and outputs have unit-order variance whatever the sizes.
  w1_ = torch::randn({in_dim, hidden}, g, torch::kFloat) / std::sqrt(static_cast<double>(in_dim));
  b1_ = torch::randn({hidden}, g, torch::kFloat) * 0.1;
  w2_ = torch::randn({hidden, out_dim}, g, torch::kFloat) / std::sqrt(static_cast<double>(hidden));
  b2_ = torch::randn({out_dim}, g, torch::kFloat) * 0.1;
}

torch::Tensor SyntheticRegression::teacher(const torch::Tensor& x) const {
  torch::NoGradGuard no_grad;
  return torch::addmm(b2_, torch::tanh(torch::addmm(b1_, x, w1_)), w2_);
}

TensorMap SyntheticRegression::batch(int64_t step, int64_t batch_size, int rank) const {
  torch::NoGradGuard no_grad;
  at::Generator g = make_cpu_generator(
      mix_seed({seed_, kSeedTagBatch, static_cast<uint64_t>(step), static_cast<uint64_t>(rank)}));
  torch::Tensor x = torch::randn({batch_size, in_dim_}, g, torch::kFloat);
  torch::Tensor y = teacher(x);
  if (noise_ > 0) y = y + noise_ * torch::randn({batch_size, out_dim_}, g, torch::kFloat);
  return {{"x", x}, {"y", y}};
}

namespace {

class SyntheticRegressionNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const Params& p = ctx.params();
    batch_ = p.get<int64_t>("batch");
    delay_ms_ = p.get<int64_t>("delay_ms");
    uint64_t seed = p.has("seed") ? p.get<uint64_t>("seed") : ctx.run().seed;
    gen_ = std::make_unique<SyntheticRegression>(p.get<int64_t>("in_dim"), p.get<int64_t>("out_dim"),
                                                 p.get<int64_t>("hidden"), seed, p.get<double>("noise"));
    cursor_ = std::make_shared<DataCursor>();
    ctx.own_state("cursor", cursor_);
  }

  void run(StepContext& ctx) override {
    if (delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
    ctx.out("batch", gen_->batch(ctx.step(), batch_, ctx.run().rank));
    ctx.state_as<DataCursor>("cursor").batches = ctx.step();
  }

 private:
  int64_t batch_ = 0, delay_ms_ = 0;
  std::unique_ptr<SyntheticRegression> gen_;
  std::shared_ptr<DataCursor> cursor_;
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(synthetic_regression, flowrun::SyntheticRegressionNode)
