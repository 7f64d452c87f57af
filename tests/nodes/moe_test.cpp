// Mixtures of experts (issue 73; models/moe.hpp) against transformers on folders it saved itself
// (tests/fixtures/hf/make_moe_fixtures.py: qwen3moe/, mixtral/ and reference_moe.safetensors):
// loaded by the llama node's `pretrained:` as a user's graph does, each gives transformers' logits,
// router load-balancing loss, tokens per expert and every parameter's gradient after one backward
// of the loss plus the weighted auxiliary loss, within 1e-5. The grouped product the experts run
// on is each expert's matrix product over its rows, forward and backward.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "common/safetensors.hpp"
#include "models/llama/llama.hpp"
#include "models/model_state.hpp"
#include "models/moe.hpp"
#include "data_test_helpers.hpp"
#include "hf_fixture_helpers.hpp"
#include "node_test_helpers.hpp"
#include "support/run_graph.hpp"

namespace flowrun {
namespace moe_parity {  // named: the unity build puts this file beside the other parity tests

namespace fs = std::filesystem;
const std::string kFixtures = std::string(FLOWRUN_SOURCE_DIR) + "/tests/fixtures/hf";

const torch::Tensor& reference(const std::string& name) { return test::hf_reference("reference_moe.safetensors", name); }
double rel(const torch::Tensor& a, const torch::Tensor& b) { return test::rel_norm_diff(a, b); }
std::string edited_copy(const std::string& folder, const std::function<void(nlohmann::json&)>& edit) {
  return test::edited_fixture(folder, edit, "moe");
}

std::unique_ptr<test::GraphRun> load(const std::string& folder) {
  return test::load_graph_text("flowrun: 1\nrun: { steps: 1 }\nnodes:\n  model: { type: llama, with: { pretrained: '" +
                               folder + "' } }\n");
}

// The fixture `name`'s folder with output_router_logits on (as training with the aux loss is):
// logits, aux loss, counts and gradients against transformers'. Returns the parameters checked.
int check_against_transformers(const std::string& name) {
  auto g = load(edited_copy(name, [](nlohmann::json& c) { c["output_router_logits"] = true; }));
  ModelState& state = g->state<ModelState>("model", "params");
  const auto* llama = state.module->as<llama::LlamaImpl>();
  const torch::Tensor tokens = reference(name + ".tokens").to(torch::kLong);
  const torch::Tensor logits = state.forward({{"tokens", tokens}});
  EXPECT_LT(rel(logits, reference(name + ".logits")), 1e-5);
  // The load-balancing loss, weighted by router_aux_loss_coef (0.02 in both fixtures), as the
  // objective adds it (ModelState::extra_loss).
  EXPECT_TRUE(state.extra_loss);
  const torch::Tensor aux = state.extra_loss(*state.module);
  EXPECT_NEAR(aux.item<double>() / 0.02, reference(name + ".aux_loss").item<double>(),
              1e-5 * reference(name + ".aux_loss").item<double>());
  EXPECT_TRUE(torch::equal(llama->expert_counts().to(torch::kFloat), reference(name + ".counts")));
  const torch::Tensor ce = torch::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}),
                                                     tokens.narrow(1, 1, tokens.size(1) - 1).reshape({-1}));
  EXPECT_LT(std::abs(ce.item<double>() - reference(name + ".loss").item<double>()), 1e-5 * reference(name + ".loss").item<double>());
  state.module->zero_grad();
  (ce + aux).backward();
  int checked = 0;
  for (const auto& [pname, p] : state.named_parameters()) {
    SCOPED_TRACE(pname);
    EXPECT_TRUE(p.grad().defined());
    if (p.grad().defined()) EXPECT_LT(rel(p.grad(), reference(name + ".grad." + pname)), 1e-5);
    ++checked;
  }
  return checked;
}

TEST(Moe, GroupedLinearIsEachExpertsProductOverItsRows) {
  torch::manual_seed(0);
  const torch::Tensor x = torch::randn({10, 6}, torch::kDouble).requires_grad_(), w = torch::randn({4, 5, 6}, torch::kDouble).requires_grad_();
  const std::vector<int64_t> ends = {3, 3, 7, 10};  // expert 1 gets no row
  const torch::Tensor y = moe::grouped_linear(x, w, ends);
  const torch::Tensor want = torch::cat({x.narrow(0, 0, 3).mm(w[0].t()), x.narrow(0, 3, 4).mm(w[2].t()), x.narrow(0, 7, 3).mm(w[3].t())});
  EXPECT_TRUE(torch::allclose(y, want));
  const torch::Tensor dy = torch::randn_like(y);
  const auto got = torch::autograd::grad({y}, {x, w}, {dy});
  const auto ref = torch::autograd::grad({want}, {x, w}, {dy});
  EXPECT_TRUE(torch::allclose(got[0], ref[0]));
  EXPECT_TRUE(torch::allclose(got[1], ref[1]));
  EXPECT_EQ(got[1][1].abs().max().item<double>(), 0.0);  // no row: no gradient
}

TEST(Moe, Qwen3MoeFromItsFolderMatchesTransformersLogitsAuxLossAndGradients) {
  // qwen3moe/: 8 experts top 2 renormalised, layer 1 a dense MLP (mlp_only_layers), q/k norms,
  // experts saved one by one (mlp.experts.E.gate_proj.weight ...), fused as they load.
  const int checked = check_against_transformers("qwen3moe");
  EXPECT_EQ(checked, 3 * (2 + 6 + 3) + 2);  // per layer: 2 norms, q/k/v/o and q/k norms, the router and the 2 expert tensors (dense: 3); table, norm
}

TEST(Moe, MixtralFromItsShardedFolderMatchesTransformers) {
  // mixtral/: 4 experts top 2, every layer sparse, untied head, sharded, saved as
  // block_sparse_moe.experts.E.w1/w2/w3 and block_sparse_moe.gate.
  const int checked = check_against_transformers("mixtral");
  EXPECT_EQ(checked, 2 * (2 + 4 + 3) + 3);  // per layer: 2 norms, q/k/v/o, router + 2 expert tensors; table, norm, head
}

TEST(Moe, WithoutTheAuxLossTheLossIsTheObjectivesAlone) {
  // output_router_logits false (the folders' own setting): no extra term.
  auto g = load(kFixtures + "/qwen3moe");
  ModelState& state = g->state<ModelState>("model", "params");
  EXPECT_FALSE(state.extra_loss);
  const torch::Tensor logits = state.forward({{"tokens", reference("qwen3moe.tokens").to(torch::kLong)}});
  EXPECT_LT(rel(logits, reference("qwen3moe.logits")), 1e-5);
}

TEST(Moe, AFolderMissingAnExpertIsRefusedNamingIt) {
  const std::string dir = test::temp_dir("moe_missing") + "/qwen3moe";
  fs::create_directories(dir);
  fs::copy_file(kFixtures + "/qwen3moe/config.json", dir + "/config.json");
  safetensors::Tensors t = safetensors::load(kFixtures + "/qwen3moe/model.safetensors").tensors;
  t.erase("model.layers.2.mlp.experts.5.up_proj.weight");
  safetensors::save(dir + "/model.safetensors", t, {{"format", "pt"}});
  try {
    load(dir);
    ADD_FAILURE() << "loaded";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.2.mlp.experts.5.up_proj.weight is missing"), std::string::npos) << e.what();
  }
}

TEST(Moe, SettingsNotBuiltAreRefusedNamingThem) {
  const std::string jitter = edited_copy("mixtral", [](nlohmann::json& c) { c["router_jitter_noise"] = 0.1; });
  try {
    load(jitter);
    ADD_FAILURE() << "loaded";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("router_jitter_noise = 0.1 is not built"), std::string::npos) << e.what();
  }
  llama::Config c;
  c.layers = 2, c.dim = 32, c.heads = 4, c.kv_heads = 2, c.mlp_dim = 48, c.vocab = 64, c.context = 16;
  c.moe.experts = 4, c.moe.top_k = 2, c.moe.expert_dim = 8, c.moe.aux_loss = true;
  c.checkpoint = CheckpointPolicy::parse("blocks");
  try {
    c.check();
    ADD_FAILURE() << "accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("with activation checkpointing is not built yet"), std::string::npos) << e.what();
  }
  c.checkpoint = CheckpointPolicy::parse("none");
  c.moe.top_k = 5;
  EXPECT_THROW(c.check(), std::runtime_error);
}

// The router's z-loss (router_z_loss; ST-MoE, Zoph et al. 2022) is the mean over tokens of the
// squared log-sum-exp of the router's logits, weighted and added to the objective's loss as the
// load-balancing loss is: it reaches the routers (and what feeds them), never the experts, and
// trained alone it shrinks large logits. On a dense model, or with recompute, it is refused.
TEST(Moe, TheRouterZLossIsSTMoEsAndShrinksTheRoutersLogits) {
  torch::manual_seed(0);
  moe::Moe block(moe::Options{16, 8, 4, 2});
  {
    torch::NoGradGuard no_grad;
    for (auto& p : block->parameters()) p.normal_(0, 1);  // large logits: lse about 4 a token
  }
  const torch::Tensor x = torch::randn({32, 16});
  moe::Routing r;
  block->forward(x, &r);
  const torch::Tensor expected = torch::matmul(x, (*block->gate)["weight"].t()).logsumexp(-1).square().mean();
  EXPECT_NEAR(moe::router_z_loss({r.logits}).item<double>(), expected.item<double>(), 1e-5 * expected.item<double>());
  // Trained on it alone, the router's logits shrink.
  const double before = expected.item<double>();
  torch::optim::SGD sgd(std::vector<torch::Tensor>{(*block->gate)["weight"]}, 0.05);
  for (int step = 0; step < 50; ++step) {
    sgd.zero_grad();
    moe::Routing q;
    block->forward(x, &q);
    moe::router_z_loss({q.logits}).backward();
    sgd.step();
  }
  moe::Routing after;
  block->forward(x, &after);
  EXPECT_LT(moe::router_z_loss({after.logits}).item<double>(), 0.5 * before);

  // In the llama family: the folder's model (no load-balancing loss) with router_z_loss set beside
  // it; the extra loss's gradient reaches the routers, and not the last sparse layer's experts
  // (nothing after them feeds a router; an earlier layer's do, through the next router's input).
  auto g = test::load_graph_text("flowrun: 1\nrun: { steps: 1 }\nnodes:\n  model: { type: llama, with: { pretrained: '" +
                                 kFixtures + "/qwen3moe', router_z_loss: 0.01 } }\n");
  ModelState& state = g->state<ModelState>("model", "params");
  ASSERT_TRUE(state.extra_loss);
  state.forward({{"tokens", reference("qwen3moe.tokens").to(torch::kLong)}});
  const torch::Tensor z = state.extra_loss(*state.module);
  EXPECT_GT(z.item<double>(), 0);
  state.module->zero_grad();
  z.backward();
  int routers = 0, last_experts = 0;
  std::string last_layer;  // "model.layers.N.", the last sparse layer's
  for (const auto& p : state.module->named_parameters())
    if (p.key().find("mlp.experts.") != std::string::npos) last_layer = p.key().substr(0, p.key().find("mlp."));
  for (const auto& p : state.module->named_parameters()) {
    const double g_norm = p.value().grad().defined() ? p.value().grad().norm().item<double>() : 0.0;
    if (p.key().find("mlp.gate.weight") != std::string::npos) routers += g_norm > 0;
    if (p.key().rfind(last_layer + "mlp.experts.", 0) == 0) {
      EXPECT_EQ(g_norm, 0.0) << p.key();
      ++last_experts;
    }
  }
  EXPECT_EQ(routers, 2);  // the fixture's two sparse layers
  EXPECT_EQ(last_experts, 2);

  llama::Config dense;
  dense.layers = 2, dense.dim = 32, dense.heads = 4, dense.kv_heads = 2, dense.mlp_dim = 48, dense.vocab = 64, dense.context = 16;
  dense.moe.z_loss_coef = 0.001;
  try {
    dense.check();
    ADD_FAILURE() << "accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("router_z_loss is 0.001, and this model has no router"), std::string::npos) << e.what();
  }
  llama::Config recomputed = dense;
  recomputed.moe.experts = 4, recomputed.moe.top_k = 2, recomputed.moe.expert_dim = 8;
  recomputed.checkpoint = CheckpointPolicy::parse("blocks");
  try {
    recomputed.check();
    ADD_FAILURE() << "accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("the router's z-loss (router_z_loss) with pipeline parallel or activation"),
              std::string::npos) << e.what();
  }
}

// The load-balancing loss does what it is for: a router that sends nearly every token to the same 2
// of 8 experts (balance 4, 4 experts unused), trained on that loss alone, spreads them (balance
// 1.3 measured, no expert unused). (A router so saturated that those 2 hold all the probability
// gets no gradient from it: the loss is then experts x their summed mean probability, flat.)
TEST(Moe, TheLoadBalancingLossSpreadsACollapsedRouter) {
  torch::manual_seed(3);
  moe::Moe block(moe::Options{16, 8, 8, 2, true});
  const torch::Tensor common = torch::randn({16});
  const torch::Tensor x = torch::randn({512, 16}) + common;  // tokens apart, with a direction in common
  {
    torch::NoGradGuard no_grad;
    block->experts->parameters()[0].normal_(0, 0.1), block->experts->parameters()[1].normal_(0, 0.1);
    torch::Tensor w = (*block->gate)["weight"];
    w.normal_(0, 0.01);
    w[0] += 0.5 * common, w[1] += 0.45 * common;  // experts 0 and 1 nearly every token's top 2
  }
  auto balance_of = [&] {
    torch::NoGradGuard no_grad;
    moe::Routing r;
    block->forward(x, &r);
    return moe::load_metrics(r.counts.unsqueeze(0), {0});
  };
  const auto before = balance_of();
  EXPECT_GT(before[0].second, 3.9);  // balance
  EXPECT_GE(before[1].second, 4);    // unused
  torch::optim::SGD opt({(*block->gate)["weight"]}, torch::optim::SGDOptions(0.5));
  for (int i = 0; i < 200; ++i) {
    opt.zero_grad();
    moe::Routing r;
    block->forward(x, &r);
    moe::load_balancing_loss({r.logits}, 8, 2).backward();
    opt.step();
  }
  const auto after = balance_of();
  EXPECT_LT(after[0].second, 1.5);  // balance
  EXPECT_EQ(after[1].second, 0);    // unused
}

// graphs/moe.yaml itself at a tiny size by overrides, on byte tokens: it learns, the load-balancing
// loss keeps the routers spread (no expert unused, none taking most of a layer's tokens), fb.experts
// is logged, and the checkpoint exports a Qwen 3 MoE folder with the experts one by one.
TEST(Moe, TheGraphFileTrainsATinyMoeThatLearns) {
  const std::string src = FLOWRUN_SOURCE_DIR;
  const std::string shards = src + "/data/text/fortunes_byte";
  FLOWRUN_NEEDS_DATA(shards + ".train.bin");
  auto r = test::run_graph_text(
      test::read_text(src + "/graphs/moe.yaml"),
      {"data.path=" + shards, "data.seq_len=64", "data.batch=16", "model.layers=2", "model.dim=64", "model.heads=4",
       "model.kv_heads=2", "model.mlp_dim=176", "model.vocab=256", "model.context=64", "model.moe.experts=8",
       "model.moe.expert_dim=64", "opt.lr=3e-3", "opt.warmup=30", "opt.min_lr=3e-4", "run.steps=300",
       "run.log_every=50", "run.prefetch=2", "eval.every=300", "evlog.every=300", "eval.batches=20", "ckpt.every=300",
       "ckpt.exports=true"});
  double first_loss = -1, val_loss = -1, balance = -1, unused = -1;
  for (const auto& j : r.metrics) {
    if (j.contains("loss") && first_loss < 0) first_loss = j["loss"].get<double>();
    if (j.contains("val_loss")) val_loss = j["val_loss"].get<double>();
    if (j.contains("experts/balance")) balance = j["experts/balance"].get<double>(), unused = j["experts/unused"].get<double>();
  }
  ASSERT_GT(first_loss, 0);
  ASSERT_GT(val_loss, 0) << "no validation loss logged";
  EXPECT_GT(first_loss, val_loss + 0.5);
  EXPECT_LT(val_loss, 2.8);
  // Measured 2026-12-07 (2 cores): train loss 3.33 at step 50, 2.39 at 300; val loss 2.42; balance
  // 2.4-3.5 over the run, one or two of the 16 layer-expert pairs unused in a step at most.
  ASSERT_GE(balance, 1.0) << "fb.experts was not logged";
  EXPECT_LE(balance, 4.0);  // 4: every token on the same 2 of the 8 experts
  EXPECT_GE(unused, 0);
  EXPECT_LE(unused, 4);
  const std::string step = r.out_dir + "/checkpoints/step_00000300";
  const auto saved = safetensors::load(step + "/model.params.safetensors").tensors;
  EXPECT_EQ(saved.at("model.layers.1.mlp.experts.gate_up_proj").sizes(), (std::vector<int64_t>{8, 128, 64}));
  const auto exported = safetensors::load(step + "/model.safetensors").tensors;
  EXPECT_TRUE(torch::equal(exported.at("model.layers.1.mlp.experts.7.down_proj.weight"),
                           saved.at("model.layers.1.mlp.experts.down_proj")[7]));
  nlohmann::json config;
  std::ifstream(step + "/config.json") >> config;
  EXPECT_EQ(config["architectures"][0], "Qwen3MoeForCausalLM");
  EXPECT_EQ(config["num_experts"], 8);
}

}  // namespace moe_parity
}  // namespace flowrun
