// gpt: GPT-2's names and shapes, causality, the tied head, GPT-2's init, Hugging Face-style
// safetensors loading (round trip and one error listing every problem), dropout that is off
// outside forward_backward and reproducible inside, and a small model that overfits a batch.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "common/safetensors.hpp"
#include "float_compare.hpp"
#include "models/dropout.hpp"
#include "models/gpt/gpt.hpp"
#include "node_test_helpers.hpp"
#include "support/gpt_reference.hpp"
#include "train/forward_backward.hpp"
#include "train/losses.hpp"

namespace flowrun {
namespace {

gpt::Config small_config() {
  gpt::Config c;
  c.layers = 2;
  c.dim = 64;
  c.heads = 4;
  c.vocab = 100;
  c.context = 32;
  return c;
}

gpt::Gpt make_model(const gpt::Config& c, uint64_t seed = 1) {
  gpt::Gpt m(c);
  gpt::init_weights(*m, seed);
  return m;
}

torch::Tensor random_tokens(int64_t B, int64_t T, int64_t vocab, uint64_t seed) {
  at::Generator g = make_cpu_generator(seed);
  return torch::randint(vocab, {B, T}, g, torch::kLong);
}

std::string shape(const torch::Tensor& t) { return c10::str(t.sizes()); }

TEST(Gpt, ParameterNamesAndShapesAreGpt2s) {
  const gpt::Config c = small_config();
  auto m = make_model(c);
  // Hugging Face GPT2Model's named_parameters(), without "transformer.", in its order.
  std::vector<std::pair<std::string, std::vector<int64_t>>> want = {{"wte.weight", {100, 64}},
                                                                    {"wpe.weight", {32, 64}}};
  for (int i = 0; i < 2; ++i) {
    const std::string h = "h." + std::to_string(i) + ".";
    want.push_back({h + "ln_1.weight", {64}});
    want.push_back({h + "ln_1.bias", {64}});
    want.push_back({h + "attn.c_attn.weight", {64, 192}});
    want.push_back({h + "attn.c_attn.bias", {192}});
    want.push_back({h + "attn.c_proj.weight", {64, 64}});
    want.push_back({h + "attn.c_proj.bias", {64}});
    want.push_back({h + "ln_2.weight", {64}});
    want.push_back({h + "ln_2.bias", {64}});
    want.push_back({h + "mlp.c_fc.weight", {64, 256}});
    want.push_back({h + "mlp.c_fc.bias", {256}});
    want.push_back({h + "mlp.c_proj.weight", {256, 64}});
    want.push_back({h + "mlp.c_proj.bias", {64}});
  }
  want.push_back({"ln_f.weight", {64}});
  want.push_back({"ln_f.bias", {64}});

  auto state = gpt::make_state(m);
  auto got = state->named_parameters();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].first, want[i].first) << i;
    EXPECT_EQ(got[i].second.sizes().vec(), want[i].second) << want[i].first;
    EXPECT_TRUE(got[i].second.requires_grad()) << want[i].first;
  }
  EXPECT_TRUE(state->named_buffers().empty());  // the causal mask is not state

  // GPT-2 small's well-known count (tied head counted once); empty() allocates lazily.
  gpt::Gpt small(gpt::Config{});
  int64_t n = 0;
  for (const auto& p : small->parameters()) n += p.numel();
  EXPECT_EQ(n, 124439808);
}

TEST(Gpt, ForwardShapesAndTokensInput) {
  auto m = make_model(small_config());
  auto state = gpt::make_state(m);
  torch::Tensor tokens = random_tokens(3, 9, 100, 7);
  torch::Tensor logits = state->forward({{"tokens", tokens}});
  EXPECT_EQ(logits.sizes().vec(), (std::vector<int64_t>{3, 8, 100}));  // for tokens[:, :-1]
  EXPECT_TRUE(torch::equal(logits, m->forward(tokens.narrow(1, 0, 8))));
  // int32 ids work too.
  EXPECT_TRUE(torch::allclose(state->forward({{"tokens", tokens.to(torch::kInt)}}), logits));
}

TEST(Gpt, MatchesATranscriptionOfHuggingFacesGpt2) {
  // Logits and every parameter's gradient, against HF's forward written out literally, run in
  // float64 over a double copy of the model: the fast path's float32 results against values exact
  // to float32's rounding, within a bound relative to the largest (float_compare.hpp: a bias's
  // gradient sums over batch x positions, the key bias's is zero but for rounding noise, and how
  // large that noise is depends on the CPU's kernels). The double copy itself runs libtorch's
  // products: it equals the transcription to float64's rounding, the same math.
  gpt::Config c = small_config();
  c.layers = 3;
  auto m = make_model(c, 21);
  auto m64 = std::dynamic_pointer_cast<gpt::GptImpl>(m->clone());
  m64->to(torch::kDouble);
  torch::Tensor tokens = random_tokens(3, 20, 100, 2);
  torch::Tensor fast = m->forward(tokens);
  torch::Tensor ref = test::hf_gpt2_reference_forward(*m64, tokens);
  test::expect_close(fast, ref, 1e-5, "logits", 1.0);
  test::expect_close(m64->forward(tokens), ref, 1e-12, "logits of the float64 copy", 1.0);

  // An arbitrary scalar of the logits, from a fixed seed.
  torch::Tensor w = torch::randn(fast.sizes(), make_cpu_generator(3));
  auto params = m->parameters();
  auto params64 = m64->parameters();
  auto g_fast = torch::autograd::grad({(fast * w).sum()}, params);
  auto g_ref = torch::autograd::grad({(ref * w.to(torch::kDouble)).sum()}, params64);
  auto g_64 = torch::autograd::grad({(m64->forward(tokens) * w.to(torch::kDouble)).sum()}, params64);
  std::vector<std::string> names;
  for (const auto& p : m->named_parameters()) names.push_back(p.key());
  test::expect_all_close(g_fast, g_ref, 1e-5, names);
  test::expect_all_close(g_64, g_ref, 1e-12, names);
}

TEST(Gpt, IsCausal) {
  auto m = make_model(small_config());
  torch::Tensor a = random_tokens(2, 16, 100, 3);
  torch::Tensor la = m->forward(a);
  for (int64_t t : {0, 5, 14}) {
    torch::Tensor b = a.clone();
    b.narrow(1, t + 1, 16 - t - 1).copy_(random_tokens(2, 16 - t - 1, 100, 100 + t));
    torch::Tensor lb = m->forward(b);
    // Positions <= t see the same prefix: same logits. Later ones differ.
    EXPECT_TRUE(torch::allclose(la.narrow(1, 0, t + 1), lb.narrow(1, 0, t + 1), 1e-5, 1e-6)) << t;
    EXPECT_FALSE(torch::allclose(la.narrow(1, t + 1, 1), lb.narrow(1, t + 1, 1))) << t;
  }
}

TEST(Gpt, HeadIsTiedToTheTokenEmbedding) {
  auto m = make_model(small_config());
  // With ln_f's gain 0 and bias b, every position's final hidden state is b, so the logits
  // must be wte @ b: the head is wte itself, not a copy.
  torch::Tensor b = torch::randn({64});
  {
    torch::NoGradGuard ng;
    m->ln_f->weight.zero_();
    m->ln_f->bias.copy_(b);
  }
  torch::Tensor logits = m->forward(random_tokens(2, 5, 100, 1));
  torch::Tensor want = torch::mv(m->wte->weight, b).detach();
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t t = 0; t < 5; ++t) EXPECT_TRUE(torch::allclose(logits[i][t], want, 1e-5, 1e-5)) << i << "," << t;
  // And the head's gradient lands on wte.
  auto state = gpt::make_state(m);
  for (const auto& [k, _] : state->named_parameters()) EXPECT_EQ(k.find("lm_head"), std::string::npos);
}

TEST(Gpt, InitIsGpt2s) {
  gpt::Config c;
  c.layers = 4;
  c.dim = 256;
  c.heads = 4;
  c.vocab = 2000;
  c.context = 128;
  auto m = make_model(c, 5);
  const double resid = 0.02 / std::sqrt(8.0);
  for (const auto& item : m->named_parameters()) {
    const std::string& k = item.key();
    const torch::Tensor& p = item.value();
    const bool is_bias = k.size() > 5 && k.compare(k.size() - 5, 5, ".bias") == 0;
    if (k.find("ln_") != std::string::npos) {
      EXPECT_TRUE(torch::equal(p, is_bias ? torch::zeros_like(p) : torch::ones_like(p))) << k;
    } else if (is_bias) {
      EXPECT_TRUE(torch::equal(p, torch::zeros_like(p))) << k;
    } else {
      const double want = k.find("c_proj.weight") != std::string::npos ? resid : 0.02;
      EXPECT_NEAR(p.std().item<double>(), want, want * 0.03) << k;
      EXPECT_NEAR(p.mean().item<double>(), 0.0, want * 0.03) << k;
    }
  }
  // The seed alone decides.
  auto same = make_model(c, 5), other = make_model(c, 6);
  EXPECT_TRUE(torch::equal(m->h[1]->as<gpt::BlockImpl>()->mlp->fc1->weight,
                           same->h[1]->as<gpt::BlockImpl>()->mlp->fc1->weight));
  EXPECT_FALSE(torch::equal(m->wte->weight, other->wte->weight));
}

TEST(Gpt, ContextLongerThanTheModelsIsAClearError) {
  auto m = make_model(small_config());
  try {
    m->forward(random_tokens(1, 33, 100, 1));
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("context is 32"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(m->forward(random_tokens(1, 32, 100, 1)));
  EXPECT_THROW(m->forward(torch::full({1, 4}, 100, torch::kLong)), std::runtime_error);  // id >= vocab
}

TEST(Gpt, CloneIsADeepCopyWithTheSameForward) {
  auto m = make_model(small_config());
  auto state = gpt::make_state(m);
  TensorMap batch = {{"tokens", random_tokens(2, 9, 100, 4)}};
  torch::Tensor before = state->forward(batch);
  auto copy = state->clone();
  EXPECT_TRUE(torch::equal(copy->forward(batch), before));
  {
    torch::NoGradGuard ng;
    m->wte->weight.add_(1.0);
  }
  EXPECT_TRUE(torch::equal(copy->forward(batch), before));
  EXPECT_FALSE(torch::equal(state->forward(batch), before));
}

// A Hugging Face-style state dict of a model: "transformer." names, the attention buffers and
// the tied lm_head.weight, as GPT2LMHeadModel.state_dict() has them.
safetensors::Tensors hf_state_dict(gpt::GptImpl& m) {
  safetensors::Tensors out;
  for (const auto& item : m.named_parameters()) out["transformer." + item.key()] = item.value().detach().clone();
  const int64_t ctx = m.config().context;
  for (int64_t i = 0; i < m.config().layers; ++i) {
    out["transformer.h." + std::to_string(i) + ".attn.bias"] = torch::ones({1, 1, ctx, ctx}).tril().to(torch::kBool);
    out["transformer.h." + std::to_string(i) + ".attn.masked_bias"] = torch::tensor(-1e4);
  }
  out["lm_head.weight"] = m.wte->weight.detach().clone();
  return out;
}

TEST(Gpt, SafetensorsRoundTripGivesIdenticalLogits) {
  const gpt::Config c = small_config();
  auto a = make_model(c, 11);
  const std::string dir = test::temp_dir("gpt");
  const std::string file = dir + "/model.safetensors";
  safetensors::save(file, hf_state_dict(*a));

  gpt::Gpt b(c);
  gpt::init_weights(*b, 99);  // different weights before loading
  gpt::load_hf_safetensors(*b, file);
  torch::Tensor tokens = random_tokens(2, 12, 100, 5);
  EXPECT_TRUE(torch::equal(a->forward(tokens), b->forward(tokens)));

  // Names without "transformer." (and no buffers, no lm_head) load as well; bf16 files convert.
  safetensors::Tensors plain;
  for (const auto& item : a->named_parameters()) plain[item.key()] = item.value().detach().to(torch::kBFloat16);
  const std::string file2 = dir + "/plain.safetensors";
  safetensors::save(file2, plain);
  gpt::Gpt d(c);
  gpt::load_hf_safetensors(*d, file2);
  EXPECT_TRUE(torch::equal(d->wte->weight, a->wte->weight.to(torch::kBFloat16).to(torch::kFloat)));

  // Through the node: `weights:` in a graph.
  auto g = test::load_graph_text(R"(
flowrun: 1
run: { steps: 1, seed: 3 }
nodes:
  model: { type: gpt, with: { layers: 2, dim: 64, heads: 4, vocab: 100, context: 32, weights: )" +
                                 file + R"( } }
)");
  ModelState& s = g->state<ModelState>("model", "params");
  EXPECT_TRUE(torch::equal(s.forward({{"tokens", tokens}}), a->forward(tokens.narrow(1, 0, 11))));
}

TEST(Gpt, LoadingListsEveryProblemInOneError) {
  const gpt::Config c = small_config();
  auto a = make_model(c);
  safetensors::Tensors t = hf_state_dict(*a);
  t.erase("transformer.h.1.mlp.c_fc.bias");                       // missing
  t["transformer.h.0.attn.q_proj.weight"] = torch::zeros({3, 4});  // unexpected
  t["transformer.wpe.weight"] = torch::zeros({16, 64});            // mis-shaped
  const std::string file = test::temp_dir("gpt") + "/bad.safetensors";
  safetensors::save(file, t);
  gpt::Gpt b(c);
  try {
    gpt::load_hf_safetensors(*b, file);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    for (const char* s : {"bad.safetensors", "1 missing, 1 unexpected, 1 mis-shaped", "missing: h.1.mlp.c_fc.bias [256]",
                          "unexpected: transformer.h.0.attn.q_proj.weight [3, 4]",
                          "mis-shaped: transformer.wpe.weight: [16, 64] in the file, the model's is [32, 64]",
                          "the file looks like layers=2 dim=64 vocab=100 context=16"})
      EXPECT_NE(msg.find(s), std::string::npos) << "want '" << s << "' in:\n" << msg;
  }

  // An untied lm_head cannot be represented.
  safetensors::Tensors u = hf_state_dict(*a);
  u["lm_head.weight"] = u["lm_head.weight"] + 1;
  try {
    gpt::load_hf_state_dict(*b, u, "untied");
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("lm_head.weight"), std::string::npos) << e.what();
  }
}

TEST(Gpt, DropoutIsOffOutsideTrainingAndReproducibleInside) {
  gpt::Config c = small_config();
  c.dropout = 0.2;
  auto m = make_model(c);
  auto plain = make_model(small_config());  // same weights (same seed), no dropout
  torch::Tensor tokens = random_tokens(2, 10, 100, 8);
  // Outside a TrainingScope (evaluators): no dropout.
  EXPECT_TRUE(torch::equal(m->forward(tokens), plain->forward(tokens)));
  torch::Tensor a, b, other;
  {
    TrainingScope s(42);
    a = m->forward(tokens);
  }
  {
    TrainingScope s(42);
    b = m->forward(tokens);
  }
  {
    TrainingScope s(43);
    other = m->forward(tokens);
  }
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_FALSE(torch::allclose(a, plain->forward(tokens)));
  EXPECT_FALSE(torch::allclose(a, other));
  // forward_backward turns it on with its seed: same seed, same loss.
  auto state = gpt::make_state(m);
  FwdBwdOptions o;
  o.dropout_seed = 5;
  TensorMap batch = {{"tokens", tokens}};
  const double l1 = forward_backward(*state, batch, LmLoss(), o).loss.item<double>();
  const double l2 = forward_backward(*state, batch, LmLoss(), o).loss.item<double>();
  const double l0 = forward_backward(*state, batch, LmLoss(), 1).loss.item<double>();
  EXPECT_EQ(l1, l2);
  EXPECT_NE(l1, l0);
}

// run.cuda_graph refuses to capture a step that draws random numbers (a replay would draw the
// same ones every step); what it counts: a training forward with dropout draws, one without
// dropout or outside training does not.
TEST(Gpt, AStepDrawsRandomNumbersOnlyWithDropout) {
  gpt::Config c = small_config();
  c.dropout = 0.2;
  auto dropping = gpt::make_state(make_model(c));
  auto plain = gpt::make_state(make_model(small_config()));
  const TensorMap batch = {{"tokens", random_tokens(2, 10, 100, 8)}};
  FwdBwdOptions o;
  o.dropout_seed = 5;
  auto draws_of = [&](ModelState& m, const FwdBwdOptions& opt) {
    const uint64_t before = TrainingScope::draws();
    forward_backward(m, batch, LmLoss(), opt);
    return TrainingScope::draws() - before;
  };
  EXPECT_EQ(draws_of(*plain, o), 0u);
  EXPECT_EQ(draws_of(*dropping, FwdBwdOptions{}), 0u);  // no scope: an eval-mode forward
  EXPECT_GT(draws_of(*dropping, o), 0u);
}

TEST(Gpt, TwoLayerModelOverfitsOneBatch) {
  gpt::Config c;
  c.layers = 2;
  c.dim = 128;
  c.heads = 4;
  c.vocab = 64;
  c.context = 64;
  auto m = make_model(c, 2);
  auto state = gpt::make_state(m);
  TensorMap batch = {{"tokens", random_tokens(4, 33, 64, 9)}};
  torch::optim::AdamW opt(state->trainable_parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.0));
  double first = 0, loss = 0;
  for (int step = 0; step < 150; ++step) {
    loss = forward_backward(*state, batch, LmLoss(), 1).loss.item<double>();
    if (step == 0) first = loss;
    opt.step();
    if (loss < 0.05) break;
  }
  EXPECT_NEAR(first, std::log(64.0), 0.3);  // starts at chance
  EXPECT_LT(loss, 0.1);
}

// A data node for graph tests: the same tokens batch every step.
class FixedTokens : public Node {
  torch::Tensor tokens_;

 public:
  void setup(SetupContext& c) override {
    const Params& p = c.params();
    tokens_ = random_tokens(p.get<int64_t>("batch"), p.get<int64_t>("seq_len") + 1, p.get<int64_t>("vocab"), 1);
  }
  void run(StepContext& c) override { c.out("batch", TensorMap{{"tokens", tokens_}}); }
};

void register_fixed_tokens() {
  static std::once_flag once;
  std::call_once(once, [] {
    Registry::global().add(R"(type: t_fixed_tokens
doc: the same random tokens batch every step
outputs: { batch: { kind: value, type: batch, doc: "{tokens: int64 [batch, seq_len+1]}" } }
params:
  batch: { type: int, default: 4, doc: rows }
  seq_len: { type: int, default: 16, doc: tokens per row }
  vocab: { type: int, default: 64, doc: vocabulary })",
                           [] { return std::make_unique<FixedTokens>(); }, "tests");
  });
}

TEST(GptNode, TrainsInAGraphAndCountsTokens) {
  register_fixed_tokens();
  auto g = test::load_graph_text(R"(
flowrun: 1
run: { steps: 40, seed: 4, log_every: 10 }
nodes:
  data: { type: t_fixed_tokens, with: { batch: 4, seq_len: 16, vocab: 64 } }
  model: { type: gpt, with: { layers: 2, dim: 64, heads: 4, vocab: 64, context: 16 } }
  loss: { type: lm_loss }
  fb: { type: forward_backward, in: { batch: data.batch, objective: loss.objective, model: model.params }, with: { accumulate: 2 } }
  opt: { type: optimizer, in: { grads: fb.grads, model: model.params }, with: { lr: 3e-3, clip: 1.0 } }
  log: { type: metrics, in: { loss: fb.loss, tokens: fb.tokens } }
)");
  g->run();
  auto m = g->metrics();
  ASSERT_EQ(m.size(), 4u);
  EXPECT_EQ(m[0]["tokens"].get<int64_t>(), 4 * 16);
  EXPECT_LT(m[3]["loss"].get<double>(), m[0]["loss"].get<double>() - 1.0);
}

}  // namespace
}  // namespace flowrun
