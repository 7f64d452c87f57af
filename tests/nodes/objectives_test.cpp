// Objectives (train/objective.hpp): a loss is a node that owns its settings and offers them as
// the state `objective`; forward_backward, evaluator and sampler read it. The built-in ones
// (mse_loss, lm_loss, diffusion_loss) written out by hand here, and a loss registered the way a
// plugin registers one (objective_factory) training a graph without any other change.
#include <gtest/gtest.h>

#include <cmath>

#include "formats/indexed_dataset.hpp"
#include "node_test_helpers.hpp"
#include "parallel/collectives.hpp"
#include "parallel/mesh.hpp"
#include "parallel/tensor_parallel.hpp"
#include "support/run_graph.hpp"
#include "train/losses.hpp"
#include "train/objective.hpp"

namespace flowrun {
namespace {

// A linear model y = x W^T + b as a ModelState (forward reads "x").
std::shared_ptr<ModelState> linear_model(int64_t in, int64_t out, uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Linear lin(in, out);
  return std::make_shared<ModelState>(
      lin.ptr(), [](torch::nn::Module& m, const TensorMap& b) { return m.as<torch::nn::LinearImpl>()->forward(b.at("x")); },
      "linear");
}

TEST(MseLoss, IsTheMeanSquaredErrorOverEveryElementAndCountsRows) {
  auto m = linear_model(3, 2, 0);
  const TensorMap batch = {{"x", torch::randn({5, 3})}, {"y", torch::randn({5, 2})}};
  const MseLoss mse;
  torch::Tensor pred = m->forward(batch);
  const double want = (pred - batch.at("y")).pow(2).sum().item<double>() / 10.0;  // 5 rows x 2 outputs
  EXPECT_NEAR(mse.loss(*m, batch).item<double>(), want, 1e-6);
  EXPECT_EQ(mse.targets(batch), 5);
  EXPECT_EQ(mse.needs(), std::vector<std::string>{"y"});
  EXPECT_TRUE(mse.reports().empty());
}

TEST(LmLoss, IsTheMeanNextTokenCrossEntropyAndReportsPerplexity) {
  // A "model" whose logits are one fixed table row per input token: the loss is
  // -mean log softmax(table[tokens[:, t]])[tokens[:, t+1]].
  const int64_t V = 5;
  torch::manual_seed(3);
  auto table = std::make_shared<torch::nn::Module>();
  torch::Tensor w = table->register_parameter("w", torch::randn({V, V}));
  ModelState m(table, [](torch::nn::Module& mod, const TensorMap& b) {
    torch::Tensor t = b.at("tokens");
    return mod.named_parameters()["w"].index({t.narrow(1, 0, t.size(1) - 1)});
  }, "table");
  const torch::Tensor tokens = torch::tensor({{0, 1, 2, 3}, {4, 4, 0, 1}}, torch::kLong);
  double sum = 0;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < 3; ++t) {
      const torch::Tensor row = w[tokens[b][t].item<int64_t>()];
      sum -= (row - row.exp().sum().log())[tokens[b][t + 1].item<int64_t>()].item<double>();
    }
  const LmLoss lm;
  const double loss = lm.loss(m, {{"tokens", tokens}}).item<double>();
  EXPECT_NEAR(loss, sum / 6.0, 1e-5);
  EXPECT_EQ(lm.targets({{"tokens", tokens}}), 6);  // B * T
  ASSERT_EQ(lm.reports().size(), 1u);
  EXPECT_EQ(lm.reports()[0].name, "ppl");
  EXPECT_DOUBLE_EQ(lm.reports()[0].of(loss), std::exp(loss));
}

// Issue 70: the objective asks the model how its output is laid out instead of guessing from
// `tp`. A model split over tp whose logits are whole on every rank (its head not split) is scored
// whole: no collective (its group here is a place with no channel, which would refuse one), the
// same loss as unsplit. Before, any model with a tp layout was scored as vocabulary-split: off by
// the split's log(tp) on every rank, silently.
TEST(LmLoss, AsksTheModelWhetherItsLogitsAreSplitOverTheVocabulary) {
  torch::manual_seed(4);
  auto table = std::make_shared<torch::nn::Module>();
  table->register_parameter("w", torch::randn({6, 6}));
  ModelState m(table, [](torch::nn::Module& mod, const TensorMap& b) {
    torch::Tensor t = b.at("tokens");
    return mod.named_parameters()["w"].index({t.narrow(1, 0, t.size(1) - 1)});
  }, "table");
  const TensorMap batch = {{"tokens", torch::tensor({{0, 1, 2, 3, 4}, {5, 4, 3, 2, 1}}, torch::kLong)}};
  const LmLoss lm;
  const double whole = lm.loss(m, batch).item<double>();
  m.tp = std::make_shared<parallel::TpLayout>(parallel::TpLayout{
      parallel::Group::place("table", parallel::Mesh(2, 2, 1), parallel::Dim::tp, 0),
      [](const std::string&) { return parallel::TpSplit{}; }});
  EXPECT_DOUBLE_EQ(lm.loss(m, batch).item<double>(), whole);  // split model, whole logits: scored whole
  m.vocab_split_logits = true;  // says its logits are vocabulary columns: the collective is asked for
  EXPECT_THROW(lm.loss(m, batch), std::logic_error);  // (a place has no channel to run it on)
}

TEST(Objective, AMissingBatchKeyIsOneErrorListingTheBatch) {
  const LmLoss lm;
  try {
    check_needs(lm, {{"x", torch::zeros({2})}, {"y", torch::zeros({2})}});
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "objective lm_loss needs the batch's 'tokens'; it has {x, y}");
  }
  check_needs(lm, {{"tokens", torch::zeros({2, 3})}});  // no throw
}

// The graph's objective node: made at setup from the file's settings and the schema's defaults.
TEST(ObjectiveNode, MakesItsObjectiveOnceAtSetupFromTheFileAndTheSchemasDefaults) {
  auto g = test::load_graph_text(R"(
flowrun: 1
run: { steps: 3, seed: 1 }
nodes:
  data:  { type: synthetic_regression, with: { in_dim: 4, out_dim: 1, batch: 16 } }
  model: { type: mlp, with: { in_dim: 4, hidden: 8, layers: 1, out_dim: 1 } }
  loss:  { type: diffusion_loss, with: { prediction: v, cond_drop: 0.25, timesteps: 500 } }
)");
  const Objective& o = g->state<Objective>("loss", "objective");
  const auto* d = dynamic_cast<const DiffusionLoss*>(&o);
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(o.type, "diffusion_loss");
  // The schema's defaults and the file's settings, and nothing restated in C++.
  EXPECT_EQ(d->options().prediction, diffusion::Prediction::v);
  EXPECT_EQ(d->options().cond_drop, 0.25);
  EXPECT_EQ(d->options().timesteps, 500);
  EXPECT_EQ(d->options().schedule, diffusion::Schedule::scaled_linear);
  EXPECT_EQ(d->options().x_key, "latents");
  // What a sampler reads, through the interface (Objective::denoising), never this cast.
  ASSERT_EQ(o.denoising(), static_cast<const Denoising*>(d));
  EXPECT_EQ(o.denoising()->noise_schedule().timesteps(), 500);
  EXPECT_EQ(o.denoising()->prediction(), diffusion::Prediction::v);
}

TEST(ObjectiveNode, TheEvaluatorOutputsWhatItsObjectiveReportsAndRefusesOtherNames) {
  const std::string graph = R"(
flowrun: 1
run: { steps: 2, seed: 1 }
nodes:
  data:  { type: token_shards, with: { path: PATH, seq_len: 8, batch: 4 } }
  model: { type: gpt, with: { layers: 1, dim: 16, heads: 2, vocab: 256, context: 8 } }
  loss:  { type: LOSS }
  eval:  { type: evaluator, every: 2, in: { objective: loss.objective, model: model.params, data: data.dataset }, with: { batches: 1, batch: 2, split: train } }
  log:   { type: metrics, every: 2, in: { val: eval.loss, ppl: eval.ppl } }
)";
  // lm_loss reports ppl; mse_loss reports nothing beside the loss, so reading eval.ppl is a
  // setup error naming the node and what the objective offers.
  const std::string data = test::temp_dir("obj") + "/tokens";
  {
    IndexedDatasetWriter w(data + ".train", TokenDtype::UInt16);
    std::vector<int32_t> doc;
    for (int32_t p = 0; p < 4000; ++p) doc.push_back((p * 37) % 256);
    w.add_document(doc);
    w.finish();
  }
  auto with = [&](const std::string& loss) {
    std::string s = graph;
    s.replace(s.find("PATH"), 4, data);
    s.replace(s.find("LOSS"), 4, loss);
    return s;
  };
  auto r = test::run_graph_text(with("lm_loss"));
  ASSERT_EQ(r.metrics.size(), 1u);
  EXPECT_DOUBLE_EQ(r.metrics[0]["ppl"].get<double>(), std::exp(r.metrics[0]["val"].get<double>()));
  try {
    test::run_graph_text(with("mse_loss"));
    FAIL() << "no error";
  } catch (const std::exception& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("node 'eval' (evaluator): a node reads its output 'ppl', but objective mse_loss reports nothing "
                     "beside loss"),
              std::string::npos)
        << m;
  }
}

// A loss from outside the built-ins, registered as a plugin does (objective_factory): mean
// absolute error. The shared nodes use it unchanged.
class L1Loss : public Objective {
 public:
  explicit L1Loss(SetupContext& ctx) : scale_(ctx.params().get<double>("scale")) {}
  std::vector<std::string> needs() const override { return {"y"}; }
  torch::Tensor loss(ModelState& m, const TensorMap& b) const override {
    return scale_ * (m.forward(b) - b.at("y")).abs().mean();
  }
  int64_t targets(const TensorMap& b) const override { return b.at("y").size(0); }

 private:
  double scale_;
};

TEST(ObjectiveNode, ALossRegisteredLikeAPluginTrainsAGraph) {
  static std::once_flag once;
  std::call_once(once, [] {
    Registry::global().add(R"(type: t_l1_loss
doc: mean absolute error (a test objective)
stateless: true
outputs: { objective: { kind: state, type: objective, doc: the objective } }
params: { scale: { type: float, default: 1.0, min: 0, doc: a factor } })",
                           objective_factory<L1Loss>(), "tests");
  });
  auto r = test::run_graph_text(R"(
flowrun: 1
run: { steps: 60, seed: 2, log_every: 1 }
nodes:
  data:  { type: synthetic_regression, with: { in_dim: 4, out_dim: 1, batch: 64, noise: 0.0 } }
  model: { type: mlp, with: { in_dim: 4, hidden: 16, layers: 1, out_dim: 1 } }
  loss:  { type: t_l1_loss, with: { scale: 2.0 } }
  fb:    { type: forward_backward, in: { batch: data.batch, objective: loss.objective, model: model.params } }
  opt:   { type: optimizer, in: { grads: fb.grads, model: model.params }, with: { lr: 1.0e-2 } }
  log:   { type: metrics, in: { loss: fb.loss, n: fb.tokens } }
)");
  ASSERT_EQ(r.metrics.size(), 60u);
  const double first = r.metrics.front()["loss"].get<double>(), last = r.metrics.back()["loss"].get<double>();
  EXPECT_LT(last, first * 0.5) << first << " -> " << last;
  EXPECT_EQ(r.metrics.back()["n"].get<int64_t>(), 64);  // targets(): rows
}

TEST(ObjectiveNode, ForwardBackwardWithoutAnObjectiveIsAGraphErrorNamingTheInput) {
  try {
    test::load_graph_text(R"(
flowrun: 1
nodes:
  data:  { type: synthetic_regression, with: { in_dim: 4, out_dim: 1, batch: 8 } }
  model: { type: mlp, with: { in_dim: 4, hidden: 8, layers: 1, out_dim: 1 } }
  fb:    { type: forward_backward, in: { batch: data.batch, model: model.params } }
)");
    FAIL() << "no error";
  } catch (const GraphError& e) {
    const std::string m = e.diagnostics().str();
    EXPECT_NE(m.find("nodes.fb.in.objective: missing input 'objective' (state objective"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace flowrun
