// synthetic_regression: a seeded data source for tests, demos and benchmarks.
// Schema: schemas/synthetic_regression.yaml. Test: tests/nodes/synthetic_regression_test.cpp.
#include "data/synthetic_regression.hpp"

#include <chrono>
#include <cmath>
#include <stdexcept>
#include <thread>

#include "parallel/mesh.hpp"
#include "common/batch_keys.hpp"
#include "common/device.hpp"
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

TensorMap SyntheticRegression::batch(int64_t step, int64_t batch_size, int rank, int world) const {
  if (world < 1 || rank < 0 || rank >= world)
    throw std::invalid_argument("synthetic_regression: rank " + std::to_string(rank) + " is not in a world of " +
                                std::to_string(world));
  torch::NoGradGuard no_grad;
  // The global batch of the step. The literal 0 is where the rank used to go into the seed:
  // kept so that a single process draws exactly the batches it always has.
  const int64_t rows = world * batch_size;
  at::Generator g = make_cpu_generator(mix_seed({seed_, kSeedTagBatch, static_cast<uint64_t>(step), uint64_t{0}}));
  torch::Tensor x = torch::randn({rows, in_dim_}, g, torch::kFloat);
  torch::Tensor y = teacher(x);
  if (noise_ > 0) y = y + noise_ * torch::randn({rows, out_dim_}, g, torch::kFloat);
  if (world == 1) return {{batch_key::features, x}, {batch_key::targets, y}};
  // This rank's rows, copied: a view would keep the whole global batch alive downstream.
  const int64_t first = static_cast<int64_t>(rank) * batch_size;
  return {{batch_key::features, x.narrow(0, first, batch_size).clone()},
          {batch_key::targets, y.narrow(0, first, batch_size).clone()}};
}

namespace {

class SyntheticRegressionNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const Params& p = ctx.params();
    batch_ = p.get<int64_t>("batch");
    replica_ = parallel::replica_of(ctx.run());
    delay_ms_ = p.get<int64_t>("delay_ms");
    uint64_t seed = node_seed(ctx);
    gen_ = std::make_unique<SyntheticRegression>(p.get<int64_t>("in_dim"), p.get<int64_t>("out_dim"),
                                                 p.get<int64_t>("hidden"), seed, p.get<double>("noise"));
    cursor_ = std::make_shared<DataCursor>();
    ctx.own_state("cursor", cursor_);
  }

  void run(StepContext& ctx) override {
    if (delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
    ctx.out("batch", to_device(gen_->batch(ctx.step(), batch_, replica_.index, replica_.count), run_device(ctx.run())));
    ctx.state_as<DataCursor>("cursor").batches = ctx.step();
  }

 private:
  int64_t batch_ = 0, delay_ms_ = 0;
  parallel::Replica replica_;
  std::unique_ptr<SyntheticRegression> gen_;
  std::shared_ptr<DataCursor> cursor_;
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(synthetic_regression, flowrun::SyntheticRegressionNode)
