// evaluator: the token-weighted mean loss over the first N fixed batches of a split, without
// gradients or dropout; ppl = exp(loss); in a graph it feeds a periodic metrics node.
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>

#include "common/seed.hpp"
#include "data_test_helpers.hpp"
#include "encode/vae_encode.hpp"
#include "eval/evaluator.hpp"
#include "models/gpt/gpt.hpp"
#include "node_test_helpers.hpp"
#include "train/losses.hpp"

namespace flowrun {
namespace {

// A tiny in-memory dataset: split "val" holds 4 batches whose rows have different lengths
// (batch i has T = 3 + i targets per row), so a token-weighted mean differs from the mean of
// the batches' means; "train" holds 1.
class TinyDataset : public Dataset {
 public:
  explicit TinyDataset(int64_t vocab) : vocab_(vocab) {}
  std::vector<std::string> splits() const override { return {"train", "val"}; }
  int64_t num_batches(const std::string& split, int64_t, int, int) const override { return split == "val" ? 4 : 1; }
  TensorMap batch(const std::string& split, int64_t index, int64_t batch, int rank, int world) const override {
    if (index >= num_batches(split, batch, rank, world)) throw std::runtime_error("batch index out of range");
    at::Generator g = make_cpu_generator(mix_seed({split == "val" ? 1u : 2u, static_cast<uint64_t>(index)}));
    return {{"tokens", torch::randint(vocab_, {batch, 3 + index + 1}, g, torch::kLong)}};
  }

 private:
  int64_t vocab_;
};

// Sum over (b, t) of -log softmax(table[tokens[b, t]])[tokens[b, t+1]] and the count, by loops.
std::pair<double, int64_t> nll_by_hand(const torch::Tensor& table, const torch::Tensor& tokens) {
  const torch::Tensor table64 = table.to(torch::kDouble);
  auto tab = table64.accessor<double, 2>();
  auto tok = tokens.accessor<int64_t, 2>();
  double sum = 0;
  int64_t n = 0;
  for (int64_t b = 0; b < tokens.size(0); ++b)
    for (int64_t t = 0; t + 1 < tokens.size(1); ++t) {
      double z = 0;
      for (int64_t v = 0; v < table.size(1); ++v) z += std::exp(tab[tok[b][t]][v]);
      sum += std::log(z) - tab[tok[b][t]][tok[b][t + 1]];
      ++n;
    }
  return {sum, n};
}

TEST(Evaluator, TokenWeightedMeanOverTheFirstBatches) {
  const int64_t V = 9;
  TinyDataset data(V);
  auto model = test::bigram_model(V);
  const torch::Tensor table = model->named_parameters()[0].second.detach();
  for (int64_t n : {1, 3, 50}) {  // 50: more than the split has, so all 4
    EvalOptions o;
    o.batches = n;
    o.batch = 5;
    EvalResult r = evaluate(*model, data, LmLoss(), o);
    double sum = 0;
    int64_t count = 0;
    for (int64_t i = 0; i < std::min<int64_t>(n, 4); ++i) {
      auto [s, c] = nll_by_hand(table, data.batch("val", i, 5, 0, 1).at("tokens"));
      sum += s;
      count += c;
    }
    EXPECT_EQ(r.batches, std::min<int64_t>(n, 4));
    EXPECT_EQ(r.targets, count);
    EXPECT_NEAR(r.loss, sum / static_cast<double>(count), 1e-5) << n;
    EXPECT_NEAR(r.loss_sum, sum, 1e-5 * sum) << n;  // what ranks add up
    EXPECT_EQ(r.loss, r.loss_sum / static_cast<double>(r.targets));
  }
  // No gradients were recorded.
  EXPECT_FALSE(table.grad().defined());
  EXPECT_FALSE(model->named_parameters()[0].second.grad().defined());
}

// Rows from a fixed pool, sharded like token_shards' dataset: batch i of rank r in a world of
// W holds rows i*W*B + r*B + [0, B).
class ShardedPool : public Dataset {
 public:
  explicit ShardedPool(int64_t vocab) : vocab_(vocab) {}
  std::vector<std::string> splits() const override { return {"val"}; }
  int64_t num_batches(const std::string&, int64_t batch, int, int world) const override { return kRows / (batch * world); }
  TensorMap batch(const std::string&, int64_t index, int64_t batch, int rank, int world) const override {
    std::vector<torch::Tensor> rows;
    for (int64_t j = 0; j < batch; ++j) {
      at::Generator g = make_cpu_generator(mix_seed({3u, static_cast<uint64_t>(index * world * batch + rank * batch + j)}));
      rows.push_back(torch::randint(vocab_, {1, 6}, g, torch::kLong));
    }
    return {{"tokens", torch::cat(rows)}};
  }

 private:
  static constexpr int64_t kRows = 48;
  int64_t vocab_;
};

TEST(Evaluator, RanksSumsGiveTheMeanOfOneProcessOverTheSameRows) {
  // What the node does with 2 ranks: each evaluates its shard with batch B, the sums are added.
  // It equals one process with batch 2B: the same rows.
  const int64_t V = 11;
  ShardedPool data(V);
  auto model = test::bigram_model(V);
  EvalOptions one;
  one.batches = 3, one.batch = 8;
  const EvalResult whole = evaluate(*model, data, LmLoss(), one);
  EvalOptions part = one;
  part.batch = 4, part.world = 2;
  double loss_sum = 0;
  int64_t targets = 0, batches = 0;
  for (int r = 0; r < 2; ++r) {
    part.rank = r;
    const EvalResult x = evaluate(*model, data, LmLoss(), part);
    loss_sum += x.loss_sum, targets += x.targets, batches += x.batches;
  }
  EXPECT_EQ(targets, whole.targets);
  EXPECT_EQ(batches, 2 * whole.batches);
  EXPECT_NEAR(loss_sum / static_cast<double>(targets), whole.loss, 1e-5);
  EXPECT_NE(whole.loss, evaluate(*model, data, LmLoss(), part).loss);  // one shard alone differs
}

// A node that owns a TinyDataset (what token_shards' `dataset` port provides).
class TinyDataNode : public Node {
 public:
  void setup(SetupContext& c) override {
    c.own_state("dataset", std::shared_ptr<Dataset>(std::make_shared<TinyDataset>(c.params().get<int64_t>("vocab"))));
  }
  void run(StepContext&) override {}
};

void register_tiny_data() {
  static std::once_flag once;
  std::call_once(once, [] {
    Registry::global().add(R"(type: t_tiny_dataset
doc: a tiny in-memory Dataset
outputs: { dataset: { kind: state, access: none, type: dataset, doc: the dataset } }
params: { vocab: { type: int, default: 50, doc: vocabulary } })",
                           [] { return std::make_unique<TinyDataNode>(); }, "tests");
  });
}

TEST(EvaluatorNode, LossAndPplInAGraph) {
  register_tiny_data();
  auto g = test::load_graph_text(R"(
flowrun: 1
run: { steps: 4, seed: 2, log_every: 1 }
nodes:
  data: { type: t_tiny_dataset, with: { vocab: 50 } }
  model: { type: gpt, with: { layers: 1, dim: 32, heads: 2, vocab: 50, context: 16, dropout: 0.1 } }
  loss: { type: lm_loss }
  eval: { type: evaluator, every: 2, in: { objective: loss.objective, model: model.params, data: data.dataset }, with: { batches: 3, batch: 2 } }
  log: { type: metrics, every: 2, in: { val_loss: eval.loss, val_ppl: eval.ppl } }
)");
  g->run();
  auto m = g->metrics();
  ASSERT_EQ(m.size(), 2u);  // steps 2 and 4
  EXPECT_EQ(m[0]["step"].get<int64_t>(), 2);
  const double loss = m[0]["val_loss"].get<double>();
  EXPECT_NEAR(m[0]["val_ppl"].get<double>(), std::exp(loss), 1e-9 * std::exp(loss));
  // Same as evaluating directly (dropout is off: no TrainingScope), and about chance at init.
  EvalOptions o;
  o.batches = 3;
  o.batch = 2;
  TinyDataset data(50);
  EvalResult r = evaluate(g->state<ModelState>("model", "params"), data, LmLoss(), o);
  EXPECT_NEAR(loss, r.loss, 1e-9);
  EXPECT_NEAR(loss, std::log(50.0), 0.3);
  EXPECT_EQ(m[1]["val_loss"].get<double>(), loss);  // nothing trains the model
}

// A test objective that scores the batch's z itself: its mean (the model is not used).
class MeanOfZ : public Objective {
 public:
  explicit MeanOfZ(SetupContext&) {}
  std::vector<std::string> needs() const override { return {"z"}; }
  torch::Tensor loss(ModelState&, const TensorMap& b) const override { return b.at("z").mean(); }
  int64_t targets(const TensorMap& b) const override { return b.at("z").size(0); }
};

TEST(EvaluatorNode, WithAVaeItScoresThePosteriorMeanLatentsOfEachHeldOutBatchUnderTheEncodersKey) {
  static std::once_flag once;
  std::call_once(once, [] {
    Registry::global().add(R"(type: t_mean_of_z
doc: the mean of the batch's z (a test objective)
stateless: true
outputs: { objective: { kind: state, type: objective, doc: the objective } })",
                           objective_factory<MeanOfZ>(), "tests");
  });
  const std::string data = test::temp_dir("eval_vae");
  test::make_shapes_set(data, "all", 40);  // 4 held out
  auto g = test::load_graph_text(R"(
flowrun: 1
run: { steps: 2, seed: 2, log_every: 1 }
nodes:
  data: { type: image_text_shards, with: { path: )" + data + R"(/all, size: 16, batch: 4 } }
  enc:  { type: vae_encode, in: { batch: data.batch },
          with: { block_out_channels: [8, 16], layers_per_block: 1, norm_num_groups: 4, seed: 3, out_key: z } }
  loss: { type: t_mean_of_z }
  eval: { type: evaluator, every: 2, in: { objective: loss.objective, model: enc.params, data: data.dataset, vae: enc.params },
          with: { split: val, batches: 2, batch: 2 } }
  log:  { type: metrics, every: 2, in: { val_loss: eval.loss } }
)");
  g->run();
  const auto m = g->metrics();
  ASSERT_EQ(m.size(), 1u);
  // What the evaluator must have scored: each of the 2 held-out batches encoded as enc encodes,
  // but from the posterior mean (no noise), times scaling_factor; the row-weighted mean of the means.
  auto& enc = dynamic_cast<vae::VaeState&>(g->state<ModelState>("enc", "params"));
  const Dataset& ds = g->state<Dataset>("data", "dataset");
  VaeEncodeOptions mean;
  mean.sample = false;
  double want = 0;
  for (int64_t i = 0; i < 2; ++i)
    want += encode_latents(enc, ds.batch("val", i, 2, 0, 1).at("image"), mean).mean().item<double>() / 2;
  EXPECT_NEAR(m[0]["val_loss"].get<double>(), want, 1e-6);
  VaeEncodeOptions sampled;  // a sample would differ
  EXPECT_GT(std::abs(encode_latents(enc, ds.batch("val", 0, 2, 0, 1).at("image"), sampled).mean().item<double>() -
                     encode_latents(enc, ds.batch("val", 0, 2, 0, 1).at("image"), mean).mean().item<double>()),
            1e-6);
}

// The vae input takes any state that encodes batches (ModelState::condition, as vae_encode's
// params do), not one type; a model's params that encode nothing are refused at setup.
TEST(EvaluatorNode, AVaeInputThatEncodesNoBatchesIsRefusedNamingWhatToConnect) {
  register_tiny_data();
  try {
    test::load_graph_text(R"(
flowrun: 1
run: { steps: 1 }
nodes:
  data: { type: t_tiny_dataset }
  model: { type: gpt, with: { layers: 1, dim: 32, heads: 2, vocab: 50, context: 16 } }
  loss: { type: lm_loss }
  eval: { type: evaluator, in: { objective: loss.objective, model: model.params, data: data.dataset, vae: model.params } }
)");
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("its vae input (a gpt's params) encodes no batches; connect a vae_encode node's params"),
              std::string::npos)
        << e.what();
  }
}

TEST(EvaluatorNode, UnknownSplitIsAClearError) {
  register_tiny_data();
  try {
    test::load_graph_text(R"(
flowrun: 1
run: { steps: 1 }
nodes:
  data: { type: t_tiny_dataset }
  model: { type: gpt, with: { layers: 1, dim: 32, heads: 2, vocab: 50, context: 16 } }
  loss: { type: lm_loss }
  eval: { type: evaluator, in: { objective: loss.objective, model: model.params, data: data.dataset }, with: { split: test } }
)");
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("no split 'test'; it has {train, val}"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace flowrun
