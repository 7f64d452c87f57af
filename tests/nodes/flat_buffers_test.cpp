// Flat buffers: a model's trainable parameters, the optimizer's moments and the EMA's average
// live in one contiguous buffer per dtype and device; tensors keep their identity and values,
// and every update gives what the tensor-by-tensor update gives.
#include <gtest/gtest.h>

#include "common/flat_buffers.hpp"
#include "node_test_helpers.hpp"
#include "state/ema.hpp"
#include "train/optimizer.hpp"

namespace flowrun {
namespace {

// Linears of awkward sizes: pieces that straddle the CPU update's chunks, vector tails.
std::shared_ptr<ModelState> model(uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential seq(torch::nn::Linear(7, 5), torch::nn::Linear(5, 300), torch::nn::Linear(300, 129),
                            torch::nn::Linear(129, 3));
  return std::make_shared<ModelState>(
      seq.ptr(), [](torch::nn::Module& m, const TensorMap& b) { return m.as<torch::nn::SequentialImpl>()->forward(b.at("x")); },
      "seq");
}

bool inside(const torch::Tensor& t, const torch::Tensor& buffer) {
  const auto* b = static_cast<const char*>(buffer.data_ptr());
  const auto* p = static_cast<const char*>(t.data_ptr());
  return p >= b && p + t.nbytes() <= b + buffer.nbytes();
}

TEST(FlatLayout, GroupsByDtypeAndDeviceInTheGivenOrderOrItsReverse) {
  std::vector<torch::Tensor> ts = {torch::zeros({2, 3}), torch::zeros({4}, torch::kDouble), torch::zeros({5}),
                                   torch::zeros({1}, torch::kDouble)};
  FlatLayout l = FlatLayout::of(ts);
  ASSERT_EQ(l.groups.size(), 2u);
  EXPECT_EQ(l.groups[0].numel, 11);
  EXPECT_EQ(l.groups[1].numel, 5);
  EXPECT_EQ(l.slots[2].group, 0);
  EXPECT_EQ(l.slots[2].offset, 6);  // after tensor 0
  EXPECT_EQ(l.order, (std::vector<int>{0, 2, 1, 3}));
  FlatLayout r = FlatLayout::of(ts, /*reverse=*/true);
  EXPECT_EQ(r.slots[0].offset, 5);  // after tensor 2
  EXPECT_EQ(r.order, (std::vector<int>{2, 0, 3, 1}));
  EXPECT_EQ(r.position[0], 1);
  EXPECT_FALSE(l == r);
  // Like tensors, like layout: a model's parameters and their moments.
  std::vector<torch::Tensor> like;
  for (const auto& t : ts) like.push_back(torch::ones_like(t));
  EXPECT_TRUE(FlatLayout::of(like) == l);
}

TEST(FlatParams, TensorsKeepTheirIdentityAndValuesAndBecomeViewsOfOneBuffer) {
  auto m = model(1);
  const std::vector<torch::Tensor> ps = m->trainable_parameters();
  const auto before = test::snapshot(*m);
  std::vector<const c10::TensorImpl*> impls;
  for (const auto& p : ps) impls.push_back(p.unsafeGetTensorImpl());
  EXPECT_EQ(m->flat.buffers_of(ps), nullptr);

  m->flat.ensure(ps);
  const std::vector<torch::Tensor>* buf = m->flat.buffers_of(m->trainable_parameters());
  ASSERT_NE(buf, nullptr);
  ASSERT_EQ(buf->size(), 1u);
  for (size_t i = 0; i < ps.size(); ++i) {
    EXPECT_EQ(ps[i].unsafeGetTensorImpl(), impls[i]);
    EXPECT_TRUE(inside(ps[i], buf->front())) << i;
  }
  for (const auto& [name, p] : m->named_parameters()) EXPECT_TRUE(torch::equal(p, before.at(name))) << name;
  // Writing the buffer writes the parameters.
  {
    torch::NoGradGuard ng;
    buf->front().fill_(0.5);
  }
  for (const auto& p : ps) EXPECT_TRUE(torch::equal(p, torch::full_like(p, 0.5)));
  // Autograd still sees leaves that require grad, and fills their .grad().
  m->forward({{"x", torch::randn({4, 7})}}).sum().backward();
  for (const auto& p : ps) EXPECT_TRUE(p.grad().defined() && p.requires_grad() && p.is_leaf());
  // A second ensure() finds them in place and keeps the buffer.
  const void* data = buf->front().data_ptr();
  m->flat.ensure(ps);
  EXPECT_EQ(m->flat.buffers_of(ps)->front().data_ptr(), data);
}

TEST(FlatParams, AParameterWhoseDataWasReplacedIsNoticedAndMovedBackIn) {
  auto m = model(2);
  std::vector<torch::Tensor> ps = m->trainable_parameters();
  m->flat.ensure(ps);
  torch::Tensor fresh = torch::randn(ps[3].sizes());
  ps[3].set_data(fresh);  // e.g. a loader that assigns instead of copying
  EXPECT_EQ(m->flat.buffers_of(ps), nullptr);
  m->flat.ensure(ps);
  ASSERT_NE(m->flat.buffers_of(ps), nullptr);
  EXPECT_TRUE(torch::equal(ps[3], fresh));
  EXPECT_TRUE(inside(ps[3], m->flat.buffers_of(ps)->front()));
}

TEST(FlatParams, ACopyOfAModelOwnsItsTensorsAndIsNotFlat) {
  auto m = model(3);
  m->flat.ensure(m->trainable_parameters());
  std::shared_ptr<ModelState> c = m->clone();
  EXPECT_EQ(c->flat.buffers_of(c->trainable_parameters()), nullptr);
  ASSERT_NE(m->flat.buffers_of(m->trainable_parameters()), nullptr);
  for (const auto& p : c->trainable_parameters()) EXPECT_FALSE(inside(p, m->flat.buffers_of(m->trainable_parameters())->front()));
}

Grads random_grads(const ModelState& m, int64_t step) {
  torch::manual_seed(1000 + step);
  Grads g;
  for (const auto& p : m.trainable_parameters()) g.push_back(torch::randn_like(p));
  return g;
}

// torch.optim's AdamW with flowrun's decay rule (matrices decay, vectors do not).
std::unique_ptr<torch::optim::AdamW> torch_adamw(const ModelState& m, double lr, double wd) {
  std::vector<torch::Tensor> decay, plain;
  for (const auto& p : m.trainable_parameters()) (decays(p) ? decay : plain).push_back(p);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  auto od = std::make_unique<torch::optim::AdamWOptions>(lr);
  od->betas({0.9, 0.95}).eps(1e-8).weight_decay(wd);
  auto op = std::make_unique<torch::optim::AdamWOptions>(lr);
  op->betas({0.9, 0.95}).eps(1e-8).weight_decay(0.0);
  groups.emplace_back(decay, std::move(od));
  groups.emplace_back(plain, std::move(op));
  return std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(lr));
}

TEST(Optimizer, ManyTensorsInOnePassMatchTorchAdamwAndSgd) {
  // Flat parameters (as the optimizer node keeps them), 8 tensors of odd sizes, one of them
  // without a gradient in step 2, clipping on: the same as torch.optim, tensor by tensor.
  for (const char* kind : {"adamw", "sgd"}) {
    SCOPED_TRACE(kind);
    auto ours = model(4), ref = model(4);
    ours->flat.ensure(ours->trainable_parameters());
    OptimizerState st;
    OptimConfig cfg;
    const bool adamw = std::string(kind) == "adamw";
    cfg.rule = make_update_rule(kind, adamw ? "{beta1: 0.9, beta2: 0.95}" : "{momentum: 0.9}");
    cfg.weight_decay = 0.1, cfg.clip = 1.0;
    const double lr = 1e-2;
    std::unique_ptr<torch::optim::Optimizer> torch_opt;
    if (adamw)
      torch_opt = torch_adamw(*ref, lr, 0.1);
    else
      torch_opt = std::make_unique<torch::optim::SGD>(ref->trainable_parameters(),
                                                      torch::optim::SGDOptions(lr).momentum(0.9).weight_decay(0.0));
    std::vector<torch::Tensor> rp = ref->trainable_parameters();
    for (int64_t step = 1; step <= 4; ++step) {
      Grads g = random_grads(*ours, step);
      if (step == 2) g[5] = torch::Tensor();
      optimizer_update(st, ours->named_parameters(true), g, cfg, lr);
      // The reference: clip over the defined grads, decoupled decay by hand for SGD.
      std::vector<torch::Tensor> with_grad;
      for (size_t i = 0; i < rp.size(); ++i) {
        rp[i].mutable_grad() = g[i].defined() ? g[i].clone() : torch::Tensor();
        if (g[i].defined()) with_grad.push_back(rp[i]);
      }
      torch::nn::utils::clip_grad_norm_(with_grad, 1.0);
      if (!adamw) {
        torch::NoGradGuard ng;
        for (auto& p : with_grad)
          if (decays(p)) p.mul_(1.0 - lr * 0.1);
      }
      torch_opt->step();
    }
    auto want = ref->named_parameters(true);
    auto got = ours->named_parameters(true);
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_TRUE(torch::allclose(got[i].second, want[i].second, 1e-5, 1e-6))
          << got[i].first << " " << (got[i].second - want[i].second).abs().max().item<float>();
    EXPECT_EQ(st.slots[5].step, 3);
    EXPECT_EQ(st.slots[4].step, 4);
  }
}

TEST(Optimizer, MomentsLiveInFlatBuffersLaidOutLikeTheParameters) {
  auto m = model(5);
  m->flat.ensure(m->trainable_parameters());
  OptimizerState st;
  OptimConfig cfg;
  optimizer_update(st, m->named_parameters(true), random_grads(*m, 1), cfg, 1e-3);
  ASSERT_EQ(st.flat.size(), 2u);  // AdamW's exp_avg and exp_avg_sq
  ASSERT_EQ(st.flat[0].size(), 1u);
  EXPECT_TRUE(st.layout == m->flat.layout());
  for (const auto& s : st.slots) {
    EXPECT_TRUE(inside(s.moment("exp_avg"), st.flat[0][0])) << s.name;
    EXPECT_TRUE(inside(s.moment("exp_avg_sq"), st.flat[1][0])) << s.name;
  }
  // Restoring copies into the buffers (the views stay views), and a moment of another shape is
  // refused with its name.
  OptimizerState other;
  optimizer_update(other, m->named_parameters(true), random_grads(*m, 2), cfg, 1e-3);
  other.load(st.tensors());
  EXPECT_TRUE(torch::equal(other.flat[0][0], st.flat[0][0]));
  EXPECT_TRUE(inside(other.slots[0].moment("exp_avg"), other.flat[0][0]));
  auto bad = st.tensors();
  bad.at("1.weight.exp_avg") = torch::zeros({2, 2});
  try {
    other.load(bad);
    FAIL() << "a moment of another shape must be refused";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("'1.weight.exp_avg' has shape [2, 2]"), std::string::npos) << e.what();
  }
}

TEST(OptimizerNode, KeepsTheModelsParametersFlatAndTheEmaFollowsThemOnTheBuffers) {
  auto g = test::load_graph_text(R"(
flowrun: 1
run: { steps: 5, seed: 5 }
nodes:
  data:  { type: synthetic_regression, with: { in_dim: 4, out_dim: 1, batch: 16 } }
  model: { type: mlp, with: { in_dim: 4, hidden: 8, layers: 2, out_dim: 1 } }
  loss:  { type: mse_loss }
  fb:    { type: forward_backward, in: { batch: data.batch, objective: loss.objective, model: model.params } }
  opt:   { type: optimizer, in: { grads: fb.grads, model: model.params }, with: { kind: adamw, lr: 0.01 } }
  ema:   { type: ema, in: { model: model.params }, with: { decay: 0.5 } }
)");
  g->run();
  ModelState& m = g->state<ModelState>("model", "params");
  ASSERT_NE(m.flat.buffers_of(m.trainable_parameters()), nullptr);
  EXPECT_TRUE(g->state<OptimizerState>("opt", "state").layout == m.flat.layout());
  auto e = g->state<ModelState>("ema", "params").named_parameters();
  EXPECT_EQ(e.front().second.storage().data(), e.back().second.storage().data());
}

TEST(Ema, OnFlatBuffersEqualsTheUpdateTensorByTensor) {
  auto flat = model(6), plain = model(6);
  flat->flat.ensure(flat->trainable_parameters());
  EmaModel a(*flat), b(*plain);
  for (int k = 1; k <= 3; ++k) {
    {
      torch::NoGradGuard ng;
      torch::manual_seed(k);
      for (auto& p : flat->trainable_parameters()) p.add_(torch::randn_like(p));
      torch::manual_seed(k);
      for (auto& p : plain->trainable_parameters()) p.add_(torch::randn_like(p));
    }
    a.update(*flat, 0.7);
    b.update(*plain, 0.7);
  }
  auto ta = a.model()->tensors(), tb = b.model()->tensors();
  for (const auto& [name, t] : ta) EXPECT_TRUE(torch::equal(t, tb.at(name))) << name;
  // It did run on buffers: the average's parameters share one.
  auto ps = a.model()->named_parameters();
  EXPECT_EQ(ps.front().second.storage().data(), ps.back().second.storage().data());
}

}  // namespace
}  // namespace flowrun
