// Pretrained folders (common/pretrained.hpp) and the dit node's `pretrained:`: a HunyuanDiT2DModel
// folder as diffusers' save_pretrained lays it out (config.json with its keys, the weights in
// one file or in shards with an index), alone or inside a pipeline's folder (model_index.json),
// gives the node its sizes and its weights; what is wrong is an error naming the file.
// The folders here are written by the test from flowrun's own DiT (a file saved by diffusers
// itself is issue 33's fixture work).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "common/pretrained.hpp"
#include "common/safetensors.hpp"
#include "models/dit.hpp"
#include "models/vae.hpp"
#include "models/model_state.hpp"
#include "node_test_helpers.hpp"

namespace flowrun {
namespace {

namespace fs = std::filesystem;

void write(const std::string& path, const std::string& text) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path) << text;
}

// A tiny HunyuanDiT2DModel's config.json, with every key diffusers v0.30 writes.
nlohmann::json tiny_config() {
  return nlohmann::json::parse(R"({
    "_class_name": "HunyuanDiT2DModel", "_diffusers_version": "0.30.3", "activation_fn": "gelu-approximate",
    "attention_head_dim": 16, "cross_attention_dim": 16, "cross_attention_dim_t5": 24, "hidden_size": 32,
    "in_channels": 4, "learn_sigma": true, "mlp_ratio": 4.0, "norm_type": "layer_norm", "num_attention_heads": 2,
    "num_layers": 2, "patch_size": 2, "pooled_projection_dim": 16, "sample_size": 8, "text_len": 8,
    "text_len_t5": 8, "use_style_cond_and_image_meta_size": true})");
}

// The weights of a DiT of that config (seeded), by diffusers' names (= flowrun's).
safetensors::Tensors tiny_weights() {
  dit::Config c;
  c.hidden = 32, c.heads = 2, c.depth = 2, c.text_dim = 16, c.t5_dim = 24, c.pooled_projection_dim = 16;
  c.text_len = 8, c.text_len_t5 = 8, c.mlp_ratio = 4.0;
  dit::Dit model(c);
  dit::init_weights(*model, 11);
  safetensors::Tensors out;
  for (const auto& item : model->named_parameters()) out[item.key()] = item.value().detach().clone();
  for (const auto& item : model->named_buffers()) out[item.key()] = item.value().detach().clone();
  return out;
}

// The folder as one file; `shards` > 1: as that many shards and an index.
void save_folder(const std::string& dir, const nlohmann::json& config, int shards = 1) {
  write(dir + "/config.json", config.dump(2));
  const safetensors::Tensors w = tiny_weights();
  if (shards == 1) {
    safetensors::save(dir + "/diffusion_pytorch_model.safetensors", w);
    return;
  }
  std::vector<safetensors::Tensors> parts(static_cast<size_t>(shards));
  nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
  size_t i = 0;
  for (const auto& [name, t] : w) {
    const size_t k = i++ % parts.size();
    parts[k][name] = t;
    const std::string file = "diffusion_pytorch_model-0000" + std::to_string(k + 1) + "-of-0000" + std::to_string(shards) + ".safetensors";
    index["weight_map"][name] = file;
  }
  for (size_t k = 0; k < parts.size(); ++k)
    safetensors::save(dir + "/diffusion_pytorch_model-0000" + std::to_string(k + 1) + "-of-0000" + std::to_string(shards) +
                          ".safetensors",
                      parts[k]);
  write(dir + "/diffusion_pytorch_model.safetensors.index.json", index.dump(2));
}

std::string dit_graph(const std::string& pretrained, const std::string& more = "") {
  return "flowrun: 1\nrun: { steps: 1, seed: 1 }\nnodes:\n  model: { type: dit, with: { pretrained: '" + pretrained + "'" +
         more + " } }\n";
}

// The node's parameters equal the saved tensors, every one.
void expect_loaded(const std::string& pretrained) {
  auto g = test::load_graph_text(dit_graph(pretrained));
  const safetensors::Tensors want = tiny_weights();
  size_t n = 0;
  for (const auto& [name, t] : g->state<ModelState>("model", "params").named_parameters()) {
    ASSERT_TRUE(want.count(name)) << name;
    EXPECT_TRUE(torch::equal(t, want.at(name))) << name;
    ++n;
  }
  EXPECT_GT(n, 20u);
}

std::string error_of(const std::string& yaml) {
  try {
    test::load_graph_text(yaml);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

TEST(Pretrained, DitTakesItsSizesAndWeightsFromTheFolder) {
  const std::string dir = test::temp_dir("pre");
  save_folder(dir + "/one", tiny_config());
  expect_loaded(dir + "/one");
  save_folder(dir + "/sharded", tiny_config(), 3);
  expect_loaded(dir + "/sharded");
  // A pipeline's folder: its transformer/.
  save_folder(dir + "/pipe/transformer", tiny_config(), 2);
  write(dir + "/pipe/model_index.json",
        R"({"_class_name": "HunyuanDiTPipeline", "transformer": ["diffusers", "HunyuanDiT2DModel"], "vae": ["diffusers", "AutoencoderKL"]})");
  expect_loaded(dir + "/pipe");
  // Sizes the graph also gives must agree with config.json.
  EXPECT_NO_THROW(test::load_graph_text(dit_graph(dir + "/one", ", depth: 2, hidden: 32")));
  const std::string e = error_of(dit_graph(dir + "/one", ", depth: 3"));
  EXPECT_NE(e.find("depth is 3 in the graph, " + dir + "/one/config.json has num_layers = 2"), std::string::npos) << e;
}

TEST(Pretrained, WhatIsWrongIsAnErrorNamingTheFile) {
  const std::string dir = test::temp_dir("prebad");
  auto expect_error = [&](const std::string& folder, const std::string& want) {
    const std::string e = error_of(dit_graph(folder));
    EXPECT_NE(e.find(want), std::string::npos) << "wanted: " << want << "\ngot: " << e;
  };
  fs::create_directories(dir + "/empty");
  expect_error(dir + "/empty", dir + "/empty has neither config.json");
  expect_error(dir + "/nothing", dir + "/nothing is not a folder");
  write(dir + "/pipe/model_index.json", R"({"_class_name": "HunyuanDiTPipeline", "vae": ["diffusers", "AutoencoderKL"]})");
  expect_error(dir + "/pipe", dir + "/pipe/model_index.json has no component 'transformer' (it has: vae)");
  nlohmann::json other = tiny_config();
  other["_class_name"] = "AutoencoderKL";
  save_folder(dir + "/class", other);
  expect_error(dir + "/class", dir + "/class/config.json: _class_name is AutoencoderKL, this node reads a HunyuanDiT2DModel");
  nlohmann::json act = tiny_config();
  act["activation_fn"] = "gelu";
  save_folder(dir + "/act", act);
  expect_error(dir + "/act", "activation_fn = gelu is not built");
  nlohmann::json unknown = tiny_config();
  unknown["use_flash_rope"] = true;
  save_folder(dir + "/unknown", unknown);
  expect_error(dir + "/unknown", dir + "/unknown/config.json: use_flash_rope is not a HunyuanDiT2DModel setting");
  nlohmann::json width = tiny_config();
  width["attention_head_dim"] = 8;
  save_folder(dir + "/width", width);
  expect_error(dir + "/width", "num_attention_heads x attention_head_dim = 16 is not hidden_size 32");
  save_folder(dir + "/shard", tiny_config(), 2);
  fs::remove(dir + "/shard/diffusion_pytorch_model-00002-of-00002.safetensors");
  expect_error(dir + "/shard", dir + "/shard/diffusion_pytorch_model.safetensors.index.json names "
                               "diffusion_pytorch_model-00002-of-00002.safetensors, which is not in " + dir + "/shard");
  fs::create_directories(dir + "/noweights");
  write(dir + "/noweights/config.json", tiny_config().dump());
  expect_error(dir + "/noweights", "has no diffusion_pytorch_model.safetensors nor diffusion_pytorch_model.safetensors.index.json");
  save_folder(dir + "/both", tiny_config());
  const std::string e = error_of(dit_graph(dir + "/both", ", weights: x.safetensors"));
  EXPECT_NE(e.find("both pretrained and weights are set"), std::string::npos) << e;
}

// ---- the VAE: vae, vae_encode and the sampler's vae share the autoencoder_kl group ----

nlohmann::json tiny_vae_config() {
  return nlohmann::json::parse(R"({
    "_class_name": "AutoencoderKL", "_diffusers_version": "0.30.3", "act_fn": "silu", "block_out_channels": [16, 16],
    "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D"], "force_upcast": true, "in_channels": 3,
    "latent_channels": 4, "latents_mean": null, "latents_std": null, "layers_per_block": 1,
    "mid_block_add_attention": true, "norm_num_groups": 8, "out_channels": 3, "sample_size": 32,
    "scaling_factor": 0.43, "shift_factor": null, "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D"],
    "use_post_quant_conv": true, "use_quant_conv": true})");
}

safetensors::Tensors tiny_vae_weights() {
  vae::Config c;
  c.block_out_channels = {16, 16}, c.layers_per_block = 1, c.norm_num_groups = 8, c.scaling_factor = 0.43;
  vae::AutoencoderKL m = vae::make_autoencoder(c, vae::Part::both, "", 5);
  safetensors::Tensors out;
  for (const auto& item : m->named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

void save_vae(const std::string& dir, const nlohmann::json& config) {
  write(dir + "/config.json", config.dump(2));
  safetensors::save(dir + "/diffusion_pytorch_model.safetensors", tiny_vae_weights());
}

std::string vae_graph(const std::string& pretrained, const std::string& more = "") {
  return "flowrun: 1\nrun: { steps: 1, seed: 1 }\nnodes:\n  model: { type: vae, with: { pretrained: '" + pretrained + "'" +
         more + " } }\n";
}

TEST(Pretrained, VaeTakesItsSettingsAndWeightsFromTheFolder) {
  const std::string dir = test::temp_dir("prevae");
  save_vae(dir + "/pipe/vae", tiny_vae_config());
  write(dir + "/pipe/model_index.json", R"({"_class_name": "HunyuanDiTPipeline", "vae": ["diffusers", "AutoencoderKL"]})");
  for (const std::string& folder : {dir + "/pipe/vae", dir + "/pipe"}) {
    auto g = test::load_graph_text(vae_graph(folder));
    ModelState& m = g->state<ModelState>("model", "params");
    const safetensors::Tensors want = tiny_vae_weights();
    size_t n = 0;
    for (const auto& [name, t] : m.named_parameters()) {
      ASSERT_TRUE(want.count(name)) << name;
      EXPECT_TRUE(torch::equal(t, want.at(name))) << name;
      ++n;
    }
    EXPECT_EQ(n, want.size()) << folder;
    EXPECT_DOUBLE_EQ(static_cast<vae::VaeState&>(m).config.scaling_factor, 0.43);
  }
  // A setting also written in the graph must agree; what this VAE does not compute is refused.
  EXPECT_NO_THROW(test::load_graph_text(vae_graph(dir + "/pipe", ", latent_channels: 4, block_out_channels: [16, 16]")));
  std::string e = error_of(vae_graph(dir + "/pipe", ", latent_channels: 8"));
  EXPECT_NE(e.find("latent_channels is 8 in the graph, " + dir + "/pipe/vae/config.json has 4"), std::string::npos) << e;
  e = error_of(vae_graph(dir + "/pipe", ", block_out_channels: [16, 32]"));
  EXPECT_NE(e.find("block_out_channels is [16, 32] in the graph"), std::string::npos) << e;
  nlohmann::json shifted = tiny_vae_config();
  shifted["shift_factor"] = 0.1159;
  save_vae(dir + "/shifted", shifted);
  e = error_of(vae_graph(dir + "/shifted"));
  EXPECT_NE(e.find(dir + "/shifted/config.json: shift_factor = 0.1159 is not built"), std::string::npos) << e;
  e = error_of(vae_graph(dir + "/pipe", ", weights: x.safetensors"));
  EXPECT_NE(e.find("both pretrained and weights are set"), std::string::npos) << e;
}

}  // namespace
}  // namespace flowrun
