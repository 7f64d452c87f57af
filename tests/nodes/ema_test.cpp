// ema: ema = decay * ema + (1 - decay) * p each step, from a deep copy made at setup; it only
// reads the model.
#include <gtest/gtest.h>

#include <cmath>

#include "node_test_helpers.hpp"
#include "state/ema.hpp"

namespace flowrun {
namespace {

TEST(EmaNode, MatchesTheClosedFormForConstantParameters) {
  // The EMA starts at the initial parameters p0 (copied at setup); from step 1 on the model's
  // parameters are held at c. After k steps: ema = c + (p0 - c) * decay^k.
  const double c = 0.75, decay = 0.8;
  const int k = 7;
  auto g = test::load_graph_text(R"(
flowrun: 1
run: { steps: 7, seed: 5 }
nodes:
  model: { type: mlp, with: { in_dim: 3, hidden: 4, layers: 1, out_dim: 2 } }
  set: { type: t_set_params, in: { model: model.params }, with: { value: 0.75 } }
  ema: { type: ema, in: { model: model.params }, with: { decay: 0.8 } }
)");
  auto p0 = test::snapshot(g->state<ModelState>("model", "params"));
  g->run();
  ModelState& ema = g->state<ModelState>("ema", "params");
  ModelState& model = g->state<ModelState>("model", "params");
  const double dk = std::pow(decay, k);
  auto e = ema.tensors();
  ASSERT_EQ(e.size(), p0.size());
  for (const auto& [name, v0] : p0) {
    torch::Tensor want = c + (v0 - c) * dk;
    EXPECT_TRUE(torch::allclose(e.at(name), want, 1e-6, 1e-7)) << name;
    // The source keeps the value it was set to: the EMA never wrote it.
    EXPECT_TRUE(torch::equal(model.tensors().at(name), torch::full_like(v0, c))) << name;
  }
}

TEST(Ema, IsADeepCopyThatFollowsTheModel) {
  torch::manual_seed(0);
  torch::nn::Sequential seq(torch::nn::Linear(3, 4), torch::nn::ReLU(), torch::nn::Linear(4, 2));
  ModelState src(seq.ptr(),
                 [](torch::nn::Module& m, const TensorMap& b) { return m.as<torch::nn::SequentialImpl>()->forward(b.at("x")); },
                 "test");
  EmaModel ema(src);
  const ModelState& e = *ema.model();
  // Same values and forward, separate tensors, nothing trainable.
  TensorMap batch = {{"x", torch::randn({5, 3})}};
  EXPECT_TRUE(torch::equal(e.module->as<torch::nn::SequentialImpl>()->forward(batch.at("x")), src.forward(batch)));
  EXPECT_TRUE(e.trainable_parameters().empty());
  for (const auto& [name, t] : e.named_parameters()) EXPECT_NE(t.data_ptr(), src.tensors().at(name).data_ptr()) << name;

  // Move the source; the copy moves only on update, by (1 - decay) of the gap.
  auto before = test::snapshot(src);
  {
    torch::NoGradGuard ng;
    for (auto& p : src.trainable_parameters()) p.add_(1.0);
  }
  for (const auto& [name, t] : e.named_parameters()) EXPECT_TRUE(torch::equal(t, before.at(name))) << name;
  ema.update(src, 0.9);
  for (const auto& [name, t] : e.named_parameters())
    EXPECT_TRUE(torch::allclose(t, before.at(name) + 0.1, 1e-6, 1e-7)) << name;
  ema.update(src, 0.0);  // decay 0: a copy
  for (const auto& [name, t] : e.named_parameters()) EXPECT_TRUE(torch::equal(t, src.tensors().at(name))) << name;
}

TEST(EmaNode, AveragesOnlyWhatTheModelTrains) {
  // A model whose first layer is frozen (as LoRA freezes base weights): the EMA pairs up the
  // trainable parameters by name, and its copy of the frozen one stays as it was.
  torch::manual_seed(1);
  torch::nn::Sequential seq(torch::nn::Linear(2, 3), torch::nn::Linear(3, 1));
  seq[0]->as<torch::nn::LinearImpl>()->weight.set_requires_grad(false);
  ModelState src(seq.ptr(), nullptr, "test");
  EmaModel ema(src);
  auto before = test::snapshot(src);
  {
    torch::NoGradGuard ng;
    for (auto& [name, p] : src.named_parameters()) p.fill_(2.0);  // the frozen one too, behind its back
  }
  ema.update(src, 0.5);
  auto e = ema.model()->tensors();
  EXPECT_TRUE(torch::equal(e.at("0.weight"), before.at("0.weight")));
  EXPECT_TRUE(torch::allclose(e.at("1.weight"), (before.at("1.weight") + 2.0) / 2));
  EXPECT_TRUE(torch::allclose(e.at("0.bias"), (before.at("0.bias") + 2.0) / 2));
}

}  // namespace
}  // namespace flowrun
