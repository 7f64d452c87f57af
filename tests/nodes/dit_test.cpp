// dit: diffusers HunyuanDiT names and the long-skip structure, shapes for square and non-square
// inputs, the 2-D RoPE against a hand-written reference, text masks and the null condition,
// safetensors round trip and load errors, and base -> LoRA graphs with PEFT export.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <set>

#include "common/safetensors.hpp"
#include "models/dit/dit.hpp"
#include "models/lora.hpp"
#include "dit_test_helpers.hpp"
#include "node_test_helpers.hpp"

namespace flowrun {
namespace {

using dit_test::tiny;
using dit_test::randomize;

TensorMap make_batch(int64_t B, int64_t C, int64_t H, int64_t W, uint64_t seed, int64_t L = 5) {
  at::Generator g = make_cpu_generator(seed);
  return {{"x", torch::randn({B, C, H, W}, g)},
          {"t", torch::randint(1000, {B}, g, torch::kLong)},
          {"text_emb", torch::randn({B, L, 8}, g)},
          {"text_mask", torch::ones({B, L}, torch::kLong)}};
}

std::set<std::string> names(torch::nn::Module& m) {
  std::set<std::string> s;
  for (const auto& p : m.named_parameters()) s.insert(p.key());
  return s;
}

TEST(Dit, ParameterNamesFollowDiffusersHunyuanDiT) {
  dit::Dit m(tiny(4, 16));
  auto n = names(*m);
  for (const char* k :
       {"pos_embed.proj.weight", "pos_embed.proj.bias", "time_extra_emb.timestep_embedder.linear_1.weight",
        "time_extra_emb.timestep_embedder.linear_2.bias", "text_embedder.linear_1.weight", "text_embedder.linear_2.weight",
        "blocks.0.norm1.linear.weight", "blocks.0.norm1.norm.weight", "blocks.0.attn1.to_q.weight",
        "blocks.0.attn1.to_k.bias", "blocks.0.attn1.to_v.weight", "blocks.0.attn1.to_out.0.weight",
        "blocks.0.attn1.norm_q.weight", "blocks.0.attn1.norm_k.bias", "blocks.0.norm2.weight",
        "blocks.0.attn2.to_k.weight", "blocks.0.norm3.bias", "blocks.0.ff.net.0.proj.weight", "blocks.0.ff.net.2.weight",
        "blocks.3.skip_norm.weight", "blocks.3.skip_linear.weight", "norm_out.linear.weight", "proj_out.weight"})
    EXPECT_TRUE(n.count(k)) << k;
  // Long skips only in the second half: diffusers' skip = layer > num_layers // 2.
  for (int i = 0; i <= 2; ++i) EXPECT_FALSE(n.count("blocks." + std::to_string(i) + ".skip_linear.weight")) << i;
  EXPECT_FALSE(n.count("norm_out.norm.weight"));  // AdaLayerNormContinuous: no affine
  auto p = m->named_parameters();
  EXPECT_EQ(p["blocks.0.attn2.to_k.weight"].sizes(), torch::IntArrayRef({32, 8}));         // text_dim -> hidden
  EXPECT_EQ(p["text_embedder.linear_1.weight"].sizes(), torch::IntArrayRef({64, 16}));     // t5 -> 4*t5
  EXPECT_EQ(p["text_embedder.linear_2.weight"].sizes(), torch::IntArrayRef({8, 64}));      // -> text_dim
  EXPECT_EQ(p["blocks.3.skip_linear.weight"].sizes(), torch::IntArrayRef({32, 64}));
  EXPECT_EQ(p["blocks.0.attn1.norm_q.weight"].sizes(), torch::IntArrayRef({16}));           // head width
  EXPECT_EQ(p["proj_out.weight"].sizes(), torch::IntArrayRef({2 * 2 * 3, 32}));
  EXPECT_EQ(p["blocks.0.ff.net.0.proj.weight"].sizes(), torch::IntArrayRef({64, 32}));
  EXPECT_EQ(p["pos_embed.proj.weight"].sizes(), torch::IntArrayRef({32, 3, 2, 2}));

  // DiT-g/2's layout: 19 skip blocks (21..39) and MLP width int(1408 * 4.3637) = 6144.
  dit::Config g;
  EXPECT_EQ(g.ff_inner(), 6144);
  EXPECT_EQ(g.head_dim(), 88);
  dit::Config d40 = tiny(40);
  dit::Dit big(d40);
  auto bn = names(*big);
  int skips = 0;
  for (int i = 0; i < 40; ++i) skips += bn.count("blocks." + std::to_string(i) + ".skip_linear.weight");
  EXPECT_EQ(skips, 19);
  EXPECT_TRUE(bn.count("blocks.21.skip_linear.weight"));
  EXPECT_FALSE(bn.count("blocks.20.skip_linear.weight"));
}

// Pipeline parallel: a staged model holds its chunks' blocks (and the embeddings or the output
// layers) under the whole model's names; whole_order() lists the whole model's parameters in its
// init order, what a stage's init draws (so the stages together hold one process's values).
TEST(Dit, StagesHoldTheirBlocksUnderTheWholeModelsNamesAndTheInitOrderIsTheWholeModels) {
  for (int64_t t5 : {0, 16}) {
    dit::Config c = tiny(4, t5);
    dit::Dit whole(c);
    std::vector<std::pair<std::string, std::vector<int64_t>>> listed;
    for (const auto& p : whole->named_parameters(true)) listed.emplace_back(p.key(), p.value().sizes().vec());
    EXPECT_EQ(dit::whole_order(c), listed) << "t5 " << t5;
    auto middle_chunk = std::make_shared<Stages>();
    middle_chunk->blocks = {{0, 1}, {1, 3}, {3, 4}};
    middle_chunk->stages = 2;
    middle_chunk->mine = {1};  // the middle chunk only: blocks 1 and 2
    c.stages = middle_chunk;
    dit::Dit middle(c);
    std::set<std::string> held = names(*middle);
    for (const auto& n : held) EXPECT_TRUE(n.rfind("blocks.1.", 0) == 0 || n.rfind("blocks.2.", 0) == 0) << n;
    EXPECT_FALSE(held.empty());
    auto end_chunks = std::make_shared<Stages>(*middle_chunk);
    end_chunks->mine = {0, 2};  // the first and the last chunk
    c.stages = end_chunks;
    dit::Dit ends(c);
    held = names(*ends);
    EXPECT_TRUE(held.count("pos_embed.proj.weight") && held.count("proj_out.weight") && held.count("blocks.0.norm1.linear.weight"));
    EXPECT_FALSE(held.count("blocks.1.norm1.linear.weight"));
  }
}

TEST(Dit, ForwardShapesForSquareAndNonSquareInputs) {
  dit::Dit m(tiny());
  dit::init_weights(*m, 1);
  randomize(*m, 2);
  for (auto hw : std::vector<std::pair<int64_t, int64_t>>{{8, 8}, {6, 10}, {4, 12}}) {
    TensorMap b = make_batch(2, 3, hw.first, hw.second, 3);
    torch::Tensor y = m->forward_batch(b);
    EXPECT_EQ(y.sizes(), b["x"].sizes());
    EXPECT_TRUE(torch::isfinite(y).all().item<bool>());
  }
  TensorMap bad = make_batch(2, 3, 7, 8, 3);
  EXPECT_THROW(m->forward_batch(bad), std::runtime_error);
  TensorMap no_text = make_batch(2, 3, 8, 8, 3);
  no_text.erase("text_emb");
  try {
    m->forward_batch(no_text);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("text_emb"), std::string::npos) << e.what();
  }
}

TEST(Dit, InitZeroesTheOutputPath) {
  dit::Dit m(tiny());
  dit::init_weights(*m, 1);
  auto p = m->named_parameters();
  EXPECT_EQ(p["proj_out.weight"].abs().sum().item<double>(), 0.0);
  EXPECT_EQ(p["blocks.1.norm1.linear.weight"].abs().sum().item<double>(), 0.0);
  EXPECT_GT(p["blocks.1.attn1.to_q.weight"].abs().sum().item<double>(), 0.0);
  EXPECT_EQ(p["blocks.1.norm2.weight"].mean().item<double>(), 1.0);
  dit::Dit m2(tiny());
  dit::init_weights(*m2, 1);
  for (const auto& it : m->named_parameters()) EXPECT_TRUE(torch::equal(it.value(), m2->named_parameters()[it.key()]));
}

// The positions HunyuanDiT's pipeline gives its transformer (rope_base_grid 32): the tables
// diffusers v0.30.3's own get_resize_crop_region_for_grid + get_2d_rotary_pos_embed computed
// (tests/fixtures/make_hunyuandit_rope.py, head_dim 4: the tables are the positions' cos and
// sin) at 256, 512 and 1024 px and two aspect-ratio buckets whose crops round half to even.
// Without the base grid, the integer positions agree only at the 32 x 32 grid.
TEST(Dit, RopePositionsAreThePipelines) {
  const safetensors::File ref = safetensors::load(std::string(FLOWRUN_SOURCE_DIR) + "/tests/fixtures/hunyuandit_rope.safetensors");
  for (auto [gh, gw] : {std::pair<int64_t, int64_t>{16, 16}, {32, 32}, {64, 64}, {24, 16}, {16, 40}}) {
    const std::string grid = std::to_string(gh) + "x" + std::to_string(gw);
    const torch::Tensor& want_cos = ref.tensors.at("cos_" + grid);
    const torch::Tensor& want_sin = ref.tensors.at("sin_" + grid);
    auto [cos, sin] = dit::rope_2d(4, gh, gw, 32);
    ASSERT_EQ(cos.sizes(), want_cos.sizes()) << grid;
    EXPECT_LE((cos - want_cos).abs().max().item<double>(), 1e-5) << grid;
    EXPECT_LE((sin - want_sin).abs().max().item<double>(), 1e-5) << grid;
    auto [icos, isin] = dit::rope_2d(4, gh, gw);  // integer positions
    EXPECT_EQ(torch::allclose(icos, want_cos, 0, 1e-5) && torch::allclose(isin, want_sin, 0, 1e-5), gh == 32 && gw == 32)
        << grid;
  }
}

TEST(Dit, Rope2dMatchesAHandWrittenReference) {
  const int64_t D = 8, gh = 2, gw = 3;
  auto [cos, sin] = dit::rope_2d(D, gh, gw);
  ASSERT_EQ(cos.sizes(), torch::IntArrayRef({gh * gw, D}));
  for (int64_t r = 0; r < gh; ++r)
    for (int64_t c = 0; c < gw; ++c)
      for (int64_t i = 0; i < D; ++i) {
        // First half: column position; second half: row position; pairs share a frequency.
        const int64_t j = i % (D / 2);
        const double pos = i < D / 2 ? double(c) : double(r);
        const double freq = std::pow(10000.0, -2.0 * double(j / 2) / double(D / 2));
        EXPECT_NEAR(cos[r * gw + c][i].item<double>(), std::cos(pos * freq), 1e-6) << r << c << i;
        EXPECT_NEAR(sin[r * gw + c][i].item<double>(), std::sin(pos * freq), 1e-6) << r << c << i;
      }
  // Rotation of interleaved pairs: out[2k] = x[2k] cos - x[2k+1] sin, out[2k+1] = x[2k+1] cos + x[2k] sin.
  at::Generator g = make_cpu_generator(5);
  torch::Tensor x = torch::randn({1, 1, gh * gw, D}, g);
  torch::Tensor y = dit::apply_rope(x, cos, sin);
  for (int64_t n = 0; n < gh * gw; ++n)
    for (int64_t k = 0; k < D / 2; ++k) {
      const double a = x[0][0][n][2 * k].item<double>(), b = x[0][0][n][2 * k + 1].item<double>();
      const double cs = cos[n][2 * k].item<double>(), sn = sin[n][2 * k].item<double>();
      EXPECT_NEAR(y[0][0][n][2 * k].item<double>(), a * cs - b * sn, 1e-5);
      EXPECT_NEAR(y[0][0][n][2 * k + 1].item<double>(), b * cs + a * sn, 1e-5);
    }
  // RoPE's point: q·k depends only on the offset between positions, in both axes.
  auto [c5, s5] = dit::rope_2d(D, 5, 5);
  torch::Tensor q = torch::randn({D}, g), k = torch::randn({D}, g);
  auto rot = [&](const torch::Tensor& v, int64_t r, int64_t c) {
    return dit::apply_rope(v.view({1, D}), c5[r * 5 + c].view({1, D}), s5[r * 5 + c].view({1, D})).view({D});
  };
  const double d1 = torch::dot(rot(q, 0, 1), rot(k, 2, 3)).item<double>();
  const double d2 = torch::dot(rot(q, 2, 2), rot(k, 4, 4)).item<double>();
  const double d3 = torch::dot(rot(q, 0, 1), rot(k, 3, 2)).item<double>();
  EXPECT_NEAR(d1, d2, 1e-4);
  EXPECT_GT(std::abs(d1 - d3), 1e-3);
}

TEST(Dit, TextMaskAndNullCondition) {
  dit::Dit m(tiny());
  randomize(*m, 7);
  TensorMap b = make_batch(2, 3, 8, 8, 8);
  torch::Tensor y = m->forward_batch(b);
  // The text matters...
  TensorMap other = b;
  other["text_emb"] = b["text_emb"] + 1.0;
  EXPECT_GT((m->forward_batch(other) - y).abs().max().item<double>(), 1e-4);
  // ...but a masked token does not.
  TensorMap masked = b;
  masked["text_mask"] = b["text_mask"].clone();
  masked["text_mask"].select(1, 4).zero_();
  torch::Tensor ym = m->forward_batch(masked);
  masked["text_emb"] = b["text_emb"].clone();
  masked["text_emb"].select(1, 4).fill_(9.0);
  EXPECT_LT((m->forward_batch(masked) - ym).abs().max().item<double>(), 1e-6);
  EXPECT_GT((ym - y).abs().max().item<double>(), 1e-5);

}

TEST(Dit, T5StatesAreProjectedAndRequired) {
  dit::Dit m(tiny(2, 16));
  randomize(*m, 3);
  TensorMap b = make_batch(2, 3, 4, 4, 4);
  EXPECT_THROW(m->forward_batch(b), std::runtime_error);  // t5_dim 16 but no t5_emb
  at::Generator g = make_cpu_generator(9);
  b["t5_emb"] = torch::randn({2, 3, 16}, g);
  b["t5_mask"] = torch::ones({2, 3});
  torch::Tensor y = m->forward_batch(b);
  TensorMap b2 = b;
  b2["t5_emb"] = b["t5_emb"] * 2;
  EXPECT_GT((m->forward_batch(b2) - y).abs().max().item<double>(), 1e-5);
}

TEST(Dit, SafetensorsRoundTripGivesIdenticalOutputsAndErrorsListEveryProblem) {
  dit::Dit m(tiny());
  randomize(*m, 11);
  const std::string dir = test::temp_dir("dit");
  std::map<std::string, torch::Tensor> sd;
  for (const auto& it : m->named_parameters()) sd[it.key()] = it.value();
  safetensors::save(dir + "/model.safetensors", sd);
  dit::Dit fresh(tiny());
  dit::init_weights(*fresh, 99);
  dit::load_safetensors(*fresh, dir + "/model.safetensors");
  TensorMap b = make_batch(2, 3, 6, 8, 12);
  EXPECT_TRUE(torch::equal(m->forward_batch(b), fresh->forward_batch(b)));

  auto bad = sd;
  bad.erase("blocks.1.attn2.to_v.weight");
  bad["blocks.0.norm3.weight"] = torch::ones({7});
  bad["extra.weight"] = torch::ones({2});
  try {
    dit::load_state_dict(*fresh, bad, "bad.safetensors");
    FAIL();
  } catch (const std::runtime_error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("bad.safetensors"), std::string::npos) << w;
    EXPECT_NE(w.find("missing: blocks.1.attn2.to_v.weight"), std::string::npos) << w;
    EXPECT_NE(w.find("unexpected: extra.weight"), std::string::npos) << w;
    EXPECT_NE(w.find("mis-shaped: blocks.0.norm3.weight"), std::string::npos) << w;
  }
}

// Test data node: `batch` {image [B, 3, 8, 8]} and `cond` {text_emb [B, 5, 8], text_mask}, the
// same every step.
class FixedImages : public Node {
  TensorMap batch_, cond_;

 public:
  void setup(SetupContext& c) override {
    const int64_t B = c.params().get<int64_t>("batch");
    at::Generator g = make_cpu_generator(21);
    batch_["image"] = torch::rand({B, 3, 8, 8}, g) * 2 - 1;
    cond_["text_emb"] = torch::randn({B, 5, 8}, g);
    cond_["text_mask"] = torch::ones({B, 5}, torch::kLong);
  }
  void run(StepContext& c) override {
    c.out("batch", batch_);
    c.out("cond", cond_);
  }
};

void register_fixed_images() {
  static std::once_flag once;
  std::call_once(once, [] {
    Registry::global().add(R"(type: t_fixed_images
doc: the same images and text embeddings every step
outputs:
  batch: { kind: value, type: batch, doc: "{image: [batch, 3, 8, 8]}" }
  cond: { kind: value, type: batch, doc: "{text_emb: [batch, 5, 8], text_mask}" }
params:
  batch: { type: int, default: 4, doc: rows })",
                           [] { return std::make_unique<FixedImages>(); }, "tests");
  });
}

// The text length is stated once: the tokenizer's max_length (sampler_test's graphs connect it);
// with neither a tokenizer nor text_len the setup error says how to give one.
TEST(DitNode, TextLenIsTheTokenizersOrMustBeGiven) {
  try {
    test::load_graph_text(R"(
flowrun: 1
run: { steps: 1 }
nodes:
  model: { type: dit, with: { patch: 2, in_channels: 3, hidden: 32, depth: 2, heads: 2, text_dim: 8, t5_dim: 0 } }
)");
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("node 'model' (dit): text_len is null and no tokenizer is connected"), std::string::npos) << w;
    EXPECT_NE(w.find("in: { tokenizer: tok.tokenizer }"), std::string::npos) << w;
  }
}

TEST(DitNode, BaseRunThenLoraRunFromItsCheckpointExportsPeftAdapters) {
  register_fixed_images();
  const std::string model = "{ patch: 2, in_channels: 3, hidden: 32, depth: 4, heads: 2, mlp_ratio: 2.0, text_dim: 8, t5_dim: 0, text_len: 5,"
                            " use_style_cond_and_image_meta_size: false, learn_sigma: false";  // = tiny(); t_fixed_images has no image sizes
  auto base = test::load_graph_text(R"(
flowrun: 1
run: { steps: 6, seed: 3, log_every: 1 }
nodes:
  data: { type: t_fixed_images, with: { batch: 4 } }
  model: { type: dit, with: )" + model + R"( } }
  loss: { type: diffusion_loss, with: { x_key: image } }
  fb: { type: forward_backward, in: { batch: data.batch, cond: data.cond, objective: loss.objective, model: model.params } }
  opt: { type: optimizer, in: { grads: fb.grads, model: model.params }, with: { lr: 1e-3 } }
  ckpt: { type: checkpoint, every: 6, in: { state: [model.params] } }
)");
  base->run();
  const std::string base_file = base->out_dir + "/checkpoints/step_00000006/model.params.safetensors";
  ASSERT_TRUE(std::filesystem::exists(base_file));

  auto lora_run = test::load_graph_text(R"(
flowrun: 1
run: { steps: 6, seed: 4, log_every: 1 }
nodes:
  data: { type: t_fixed_images, with: { batch: 4 } }
  model: { type: dit, with: )" + model + ", weights: " + base_file +
                                         R"(, lora: { rank: 4, alpha: 8, targets: [to_q, to_v, to_out.0] } } }
  loss: { type: diffusion_loss, with: { x_key: image, prediction: v, cond_drop: 0.5 } }
  fb: { type: forward_backward, in: { batch: data.batch, cond: data.cond, objective: loss.objective, model: model.params } }
  opt: { type: optimizer, in: { grads: fb.grads, model: model.params }, with: { lr: 1e-2 } }
  ckpt: { type: checkpoint, every: 6, in: { state: [model.params] }, with: { exports: true } }
)");
  lora_run->run();
  const std::string folder = lora_run->out_dir + "/checkpoints/step_00000006";
  ASSERT_TRUE(std::filesystem::exists(folder + "/adapter_model.safetensors"));
  ASSERT_TRUE(std::filesystem::exists(folder + "/adapter_config.json"));
  auto cfg = nlohmann::json::parse(std::ifstream(folder + "/adapter_config.json"));
  EXPECT_EQ(cfg["peft_type"], "LORA");
  EXPECT_EQ(cfg["r"], 4);
  EXPECT_EQ(cfg["target_modules"], nlohmann::json({"to_q", "to_v", "to_out.0"}));

  ModelState& trained = lora_run->state<ModelState>("model", "params");
  // The base stayed the base run's, the adapters moved.
  safetensors::File bf = safetensors::load(base_file);
  auto tensors = trained.tensors();
  for (const auto& [k, t] : bf.tensors) EXPECT_TRUE(torch::equal(tensors.at(k), t)) << k;
  EXPECT_GT(tensors.at("blocks.0.attn1.to_q.lora_B.weight").abs().sum().item<double>(), 0.0);

  // A fresh base + the exported adapters computes what the trained model computes (with the
  // graph's RoPE positions: the schema's rope_base_grid 32).
  dit::Config fresh_cfg = tiny();
  fresh_cfg.rope_base_grid = 32;
  dit::Dit fresh(fresh_cfg);
  dit::load_safetensors(*fresh, base_file);
  auto fs = dit::make_state(fresh);
  lora::load_peft(*fs, folder);
  TensorMap b = make_batch(2, 3, 8, 8, 5);
  EXPECT_LT((fs->forward(b) - trained.forward(b)).abs().max().item<double>(), 1e-5);
}

}  // namespace
}  // namespace flowrun
