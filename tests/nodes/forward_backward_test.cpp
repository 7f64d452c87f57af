// forward_backward: the loss and grads of the objective; micro-batches give the grads of the
// whole batch; grads are the parameters' own .grad() tensors, fresh each step.
#include <gtest/gtest.h>

#include "node_test_helpers.hpp"
#include "train/forward_backward.hpp"

namespace flowrun {
namespace {

// A small MLP model (the mlp node's layout) built directly.
std::shared_ptr<ModelState> small_model(int64_t in = 3, int64_t out = 2) {
  torch::manual_seed(0);
  torch::nn::Sequential seq(torch::nn::Linear(in, 5), torch::nn::Tanh(), torch::nn::Linear(5, out));
  return std::make_shared<ModelState>(
      seq.ptr(),
      [](torch::nn::Module& m, const TensorMap& b) { return m.as<torch::nn::SequentialImpl>()->forward(b.at("x")); },
      "test");
}

TEST(ForwardBackward, MseLossAndGradsMatchAutograd) {
  auto m = small_model();
  TensorMap batch = {{"x", torch::randn({8, 3})}, {"y", torch::randn({8, 2})}};
  FwdBwdResult r = forward_backward(*m, batch, *find_objective("mse"), 1);

  // Reference: the same computation on a copy, by hand.
  auto ref = m->clone();
  torch::Tensor loss = ((ref->forward(batch) - batch.at("y")).pow(2)).mean();
  auto ref_params = ref->trainable_parameters();
  auto ref_grads = torch::autograd::grad({loss}, ref_params);

  EXPECT_EQ(r.loss.dim(), 0);
  EXPECT_FALSE(r.loss.requires_grad());
  EXPECT_NEAR(r.loss.item<double>(), loss.item<double>(), 1e-6);
  auto params = m->trainable_parameters();
  ASSERT_EQ(r.grads.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::allclose(r.grads[i], ref_grads[i], 1e-5, 1e-7)) << i;
    // Aliases of the parameters' .grad(), not copies.
    EXPECT_EQ(r.grads[i].data_ptr(), params[i].grad().data_ptr()) << i;
  }
}

TEST(ForwardBackward, MicroBatchesGiveTheWholeBatchsGrads) {
  auto m = small_model();
  TensorMap batch = {{"x", torch::randn({10, 3})}, {"y", torch::randn({10, 2})}};
  FwdBwdResult whole = forward_backward(*m, batch, *find_objective("mse"), 1);
  std::vector<torch::Tensor> want;
  for (const auto& g : whole.grads) want.push_back(g.clone());
  // 10 rows in 3 parts (4, 3, 3) and in 10 parts of one row each.
  for (int64_t acc : {2, 3, 10}) {
    FwdBwdResult r = forward_backward(*m, batch, *find_objective("mse"), acc);
    EXPECT_NEAR(r.loss.item<double>(), whole.loss.item<double>(), 1e-6) << acc;
    for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(torch::allclose(r.grads[i], want[i], 1e-5, 1e-7)) << acc;
  }
}

TEST(ForwardBackward, GradsAreFreshEachStep) {
  // The previous step's grads, still held by their consumers, are not added to or overwritten.
  auto m = small_model();
  TensorMap b1 = {{"x", torch::randn({4, 3})}, {"y", torch::randn({4, 2})}};
  TensorMap b2 = {{"x", torch::randn({4, 3})}, {"y", torch::randn({4, 2})}};
  FwdBwdResult r1 = forward_backward(*m, b1, *find_objective("mse"), 1);
  std::vector<torch::Tensor> kept;
  for (const auto& g : r1.grads) kept.push_back(g.clone());
  FwdBwdResult r2 = forward_backward(*m, b2, *find_objective("mse"), 1);
  auto fresh = small_model();  // same init (seed 0)
  FwdBwdResult only2 = forward_backward(*fresh, b2, *find_objective("mse"), 1);
  for (size_t i = 0; i < kept.size(); ++i) {
    EXPECT_TRUE(torch::equal(r1.grads[i], kept[i])) << i;
    EXPECT_TRUE(torch::allclose(r2.grads[i], only2.grads[i])) << i;
  }
}

TEST(ForwardBackward, SplitBatch) {
  TensorMap b = {{"x", torch::arange(10).view({5, 2})}, {"w", torch::tensor(3.0)}};
  auto parts = split_batch(b, 2);
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(parts[0].at("x").size(0), 3);
  EXPECT_EQ(parts[1].at("x").size(0), 2);
  EXPECT_EQ(parts[1].at("x")[0][0].item<int64_t>(), 6);
  EXPECT_EQ(parts[1].at("w").item<double>(), 3.0);  // 0-d tensors go to every part
  EXPECT_THROW(split_batch(b, 6), std::runtime_error);
  TensorMap bad = {{"x", torch::zeros({5, 2})}, {"y", torch::zeros({4, 1})}};
  EXPECT_THROW(split_batch(bad, 2), std::runtime_error);
}

TEST(ForwardBackward, ErrorsSayWhatIsMissing) {
  auto m = small_model();
  TensorMap no_y = {{"x", torch::randn({4, 3})}};
  try {
    forward_backward(*m, no_y, *find_objective("mse"), 1);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("'y'"), std::string::npos) << e.what();
  }
  TensorMap wrong_shape = {{"x", torch::randn({4, 3})}, {"y", torch::randn({4, 3})}};
  EXPECT_THROW(forward_backward(*m, wrong_shape, *find_objective("mse"), 1), std::runtime_error);
  EXPECT_EQ(find_objective("nope"), nullptr);
}

TEST(ForwardBackwardNode, AccumulateInAGraph) {
  // The same two-step training with accumulate 1 and 4 ends at the same parameters.
  const std::string yaml = R"(
flowrun: 1
run: { steps: 2, seed: 3 }
nodes:
  data: { type: synthetic_regression, with: { in_dim: 4, batch: 16 } }
  model: { type: mlp, with: { in_dim: 4, hidden: 8, layers: 1 } }
  fb: { type: forward_backward, in: { batch: data.batch, model: model.params } }
  opt: { type: optimizer, in: { grads: fb.grads, model: model.params }, with: { kind: sgd, lr: 0.1 } }
)";
  auto a = test::load_graph_text(yaml);
  auto b = test::load_graph_text(yaml, {"fb.accumulate=4"});
  a->run();
  b->run();
  auto pa = test::snapshot(a->state<ModelState>("model", "params"));
  auto pb = test::snapshot(b->state<ModelState>("model", "params"));
  for (const auto& [k, v] : pa) EXPECT_TRUE(torch::allclose(v, pb.at(k), 1e-5, 1e-6)) << k;
}

}  // namespace
}  // namespace flowrun
