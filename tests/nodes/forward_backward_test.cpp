// forward_backward: the loss and grads of the objective; micro-batches give the grads of the
// whole batch; grads are the parameters' own .grad() tensors, fresh each step.
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>

#include <cmath>

#include "common/seed.hpp"
#include "models/gpt.hpp"
#include "node_test_helpers.hpp"
#include "train/cross_entropy.hpp"
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

// A "language model" whose logits are a trainable table indexed by the previous token:
// logits[b, t] = table[tokens[b, t]] (a bigram model), so a test can compute the loss by hand.
std::shared_ptr<ModelState> bigram_model(int64_t vocab) {
  auto m = std::make_shared<torch::nn::Module>();
  m->register_parameter("table", torch::randn({vocab, vocab}));
  return std::make_shared<ModelState>(
      m,
      [](torch::nn::Module& mod, const TensorMap& b) {
        const torch::Tensor& tok = b.at("tokens");
        return torch::embedding(mod.named_parameters()["table"], tok.narrow(1, 0, tok.size(1) - 1));
      },
      "bigram");
}

// -mean over (b, t) of log softmax(logits[b, t])[tokens[b, t+1]], in doubles, by loops.
double cross_entropy_by_hand(const torch::Tensor& table, const torch::Tensor& tokens) {
  const torch::Tensor table64 = table.to(torch::kDouble);
  auto tab = table64.accessor<double, 2>();
  auto tok = tokens.accessor<int64_t, 2>();
  const int64_t V = table.size(1);
  double sum = 0;
  int64_t n = 0;
  for (int64_t b = 0; b < tokens.size(0); ++b)
    for (int64_t t = 0; t + 1 < tokens.size(1); ++t) {
      const int64_t prev = tok[b][t], next = tok[b][t + 1];
      double z = 0;
      for (int64_t v = 0; v < V; ++v) z += std::exp(tab[prev][v]);
      sum += -(tab[prev][next] - std::log(z));
      ++n;
    }
  return sum / static_cast<double>(n);
}

TEST(ForwardBackward, LmIsTheMeanNextTokenCrossEntropy) {
  torch::manual_seed(1);
  auto m = bigram_model(7);
  torch::Tensor tokens = torch::randint(7, {3, 6}, torch::kLong);
  TensorMap batch = {{"tokens", tokens}};
  const ObjectiveDef* lm = find_objective_def("lm");
  ASSERT_NE(lm, nullptr);
  const double want = cross_entropy_by_hand(m->named_parameters()[0].second.detach(), tokens);
  FwdBwdResult r = forward_backward(*m, batch, lm->loss, 1);
  EXPECT_NEAR(r.loss.item<double>(), want, 1e-5);
  EXPECT_EQ(lm->targets(batch), 3 * 5);  // B * T
  EXPECT_EQ(find_objective_def("mse")->targets({{"x", torch::zeros({4, 2})}, {"y", torch::zeros({4, 1})}}), 4);
  // Micro-batches: same loss (every row has T targets, so row shares are token shares).
  EXPECT_NEAR(forward_backward(*m, batch, lm->loss, 3).loss.item<double>(), want, 1e-5);

  // Errors name what is wrong.
  EXPECT_THROW(forward_backward(*m, {{"x", tokens}}, lm->loss, 1), std::runtime_error);
  EXPECT_THROW(forward_backward(*m, {{"tokens", tokens.narrow(1, 0, 1)}}, lm->loss, 1), std::runtime_error);
}

TEST(CrossEntropy, FusedMatchesTorchsValueAndGradient) {
  // V = 300000 makes the CPU path use chunks of 3 rows: 10 rows are 4 chunks, the last partial.
  for (int64_t V : {7, 300000}) {
    at::Generator g = make_cpu_generator(static_cast<uint64_t>(V));
    torch::Tensor x = (torch::randn({10, V}, g) * 4).requires_grad_(true);
    torch::Tensor t = torch::randint(V, {10}, g, torch::kLong);
    torch::Tensor mine = cross_entropy_mean(x, t);
    // Reference: torch's cross_entropy in double (fp32 sums over 300k terms differ by ~1e-6
    // relative between summation orders, torch's own fp32 result included).
    torch::Tensor x64 = x.detach().to(torch::kDouble).requires_grad_(true);
    torch::Tensor ref = torch::nn::functional::cross_entropy(x64, t);
    EXPECT_NEAR(mine.item<double>(), ref.item<double>(), 1e-6 * ref.item<double>()) << V;
    torch::Tensor w = torch::tensor(1.7);  // a non-unit upstream gradient
    auto gm = torch::autograd::grad({mine * w}, {x})[0];
    auto gr = torch::autograd::grad({ref * w}, {x64})[0].to(torch::kFloat);
    EXPECT_TRUE(torch::allclose(gm, gr, 1e-5, 1e-7)) << V << ": " << (gm - gr).abs().max().item<double>();
  }
  EXPECT_THROW(cross_entropy_mean(torch::zeros({2, 3}, torch::kBFloat16), torch::zeros({2}, torch::kLong)),
               std::runtime_error);
}

gpt::Gpt tiny_gpt() {
  gpt::Config c;
  c.layers = 2;
  c.dim = 64;
  c.heads = 4;
  c.vocab = 50;
  c.context = 32;
  gpt::Gpt m(c);
  gpt::init_weights(*m, 3);
  return m;
}

TEST(ForwardBackward, Bf16AutocastOnCpuIsCloseToFp32) {
  auto state = gpt::make_state(tiny_gpt());
  at::Generator g = make_cpu_generator(5);
  TensorMap batch = {{"tokens", torch::randint(50, {4, 17}, g, torch::kLong)}};
  FwdBwdOptions o;
  FwdBwdResult f32 = forward_backward(*state, batch, *find_objective("lm"), o);
  std::vector<torch::Tensor> g32;
  for (const auto& t : f32.grads) g32.push_back(t.clone());
  o.precision = Precision::bf16;
  FwdBwdResult b16 = forward_backward(*state, batch, *find_objective("lm"), o);
  const double l32 = f32.loss.item<double>(), l16 = b16.loss.item<double>();
  EXPECT_TRUE(std::isfinite(l16));
  EXPECT_NE(l16, l32);  // autocast really ran in bf16
  EXPECT_NEAR(l16, l32, 0.02 * l32);
  // Grads stay fp32 (the parameters' dtype), finite and close in direction.
  for (size_t i = 0; i < g32.size(); ++i) {
    ASSERT_EQ(b16.grads[i].scalar_type(), torch::kFloat) << i;
    EXPECT_TRUE(torch::isfinite(b16.grads[i]).all().item<bool>()) << i;
    const double cos = torch::cosine_similarity(b16.grads[i].flatten(), g32[i].flatten(), 0).item<double>();
    EXPECT_GT(cos, 0.95) << i;
  }
  // The autocast state is restored after the call.
  EXPECT_FALSE(at::autocast::is_cpu_enabled());
}

TEST(ForwardBackwardNode, PrecisionFromTheRun) {
  const std::string yaml = R"(
flowrun: 1
run: { steps: 1, seed: 3 }
nodes:
  data: { type: synthetic_regression, with: { in_dim: 4, batch: 16 } }
  model: { type: mlp, with: { in_dim: 4, hidden: 8, layers: 1 } }
  fb: { type: forward_backward, in: { batch: data.batch, model: model.params } }
  log: { type: metrics, in: { loss: fb.loss, rows: fb.tokens } }
)";
  try {
    test::load_graph_text(yaml, {"run.precision=fp16"});
    FAIL() << "fp16 accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("fp16 is not supported"), std::string::npos) << e.what();
  }
  auto g = test::load_graph_text(yaml, {"run.precision=bf16"});
  g->run();
  auto m = g->metrics();
  ASSERT_EQ(m.size(), 1u);
  EXPECT_TRUE(std::isfinite(m[0]["loss"].get<double>()));
  EXPECT_EQ(m[0]["rows"].get<int64_t>(), 16);
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
