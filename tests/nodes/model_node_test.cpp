// ModelNode (nodes/models/model_node.hpp): what every model node does alike, whatever its family:
// a `weights` file replaces the seeded init and a missing one is refused saying what it should
// be; LoRA adapters keep their own init over a loaded base.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "common/safetensors.hpp"
#include "models/model_state.hpp"
#include "node_test_helpers.hpp"

using namespace flowrun;

namespace {

// Each family at a tiny size (`with:` of its node).
const std::map<std::string, std::string> kTiny = {
    {"gpt", "layers: 1, dim: 16, heads: 2, vocab: 32, context: 8"},
    {"cappa", "image_size: 16, patch: 8, width: 16, depth: 1, heads: 2, mlp_dim: 32, dec_width: 16, dec_depth: 1, "
              "dec_heads: 2, dec_mlp_dim: 32, vocab: 32, max_len: 8"},
    {"dit", "depth: 1, hidden: 32, heads: 2, mlp_ratio: 2.0, text_dim: 16, t5_dim: 16, text_len: 4, text_len_t5: 4, "
            "pooled_projection_dim: 16"},
    {"vae", "block_out_channels: [16, 16], layers_per_block: 1, latent_channels: 4, norm_num_groups: 8"},
};

std::string one_model(const std::string& type, const std::string& more, int seed = 1) {
  return "flowrun: 1\nrun: { steps: 1, seed: " + std::to_string(seed) + " }\nnodes:\n  model: { type: " + type +
         ", with: { " + kTiny.at(type) + more + " } }\n";
}

// The model's parameters by name, copied.
safetensors::Tensors params_of(const std::string& yaml) {
  auto g = test::load_graph_text(yaml);
  safetensors::Tensors out;
  for (const auto& [name, t] : g->state<ModelState>("model", "params").named_parameters()) out[name] = t.detach().clone();
  return out;
}

}  // namespace

TEST(ModelNode, AMissingWeightsFileIsRefusedSayingWhatItShouldBe) {
  for (const auto& [type, _] : kTiny) {
    const std::string e = test::graph_error(one_model(type, ", weights: /no/such/model.safetensors"));
    EXPECT_NE(e.find("'model' (" + type + "): weights: /no/such/model.safetensors does not exist (it should be "),
              std::string::npos)
        << type << ": " << e;
    EXPECT_NE(e.find("set model.weights=PATH, or null to start from the seeded init"), std::string::npos) << e;
  }
}

// Every family: the file gives every value; the node's seed no longer matters.
TEST(ModelNode, WeightsReplaceTheSeededInitOfEveryFamily) {
  const std::string dir = test::temp_dir("model_node");
  for (const auto& [type, _] : kTiny) {
    const safetensors::Tensors saved = params_of(one_model(type, "", /*seed=*/1));
    const safetensors::Tensors other = params_of(one_model(type, "", /*seed=*/2));
    bool differs = false;
    for (const auto& [name, t] : saved) differs = differs || !torch::equal(t, other.at(name));
    ASSERT_TRUE(differs) << type << ": seeds 1 and 2 gave the same init, so loading would show nothing";
    const std::string file = dir + "/" + type + ".safetensors";
    safetensors::save(file, saved);
    const safetensors::Tensors loaded = params_of(one_model(type, ", weights: " + file, /*seed=*/2));
    ASSERT_EQ(loaded.size(), saved.size()) << type;
    for (const auto& [name, t] : saved) EXPECT_TRUE(torch::equal(loaded.at(name), t)) << type << " " << name;
  }
}

// LoRA over a loaded base: the base is the file's, the adapters are what the seed makes with no
// file at all (their own generator, models/lora.cpp), and only the adapters train.
TEST(ModelNode, LoraAdaptersKeepTheirInitOverALoadedBase) {
  const std::string dir = test::temp_dir("model_node_lora");
  const safetensors::Tensors base = params_of(one_model("gpt", "", /*seed=*/5));
  safetensors::save(dir + "/base.safetensors", base);
  const std::string lora = ", lora: { rank: 2, targets: [c_attn] }";
  auto g = test::load_graph_text(one_model("gpt", lora + ", weights: " + dir + "/base.safetensors", /*seed=*/3));
  const safetensors::Tensors unloaded = params_of(one_model("gpt", lora, /*seed=*/3));
  int adapters = 0;
  for (const auto& [name, t] : g->state<ModelState>("model", "params").named_parameters()) {
    if (name.find("lora_") != std::string::npos) {
      ++adapters;
      EXPECT_TRUE(t.requires_grad()) << name;
      EXPECT_TRUE(torch::equal(t, unloaded.at(name))) << name;
    } else {
      EXPECT_FALSE(t.requires_grad()) << name;
      EXPECT_TRUE(torch::equal(t, base.at(name))) << name;
    }
  }
  EXPECT_EQ(adapters, 2);  // lora_A and lora_B of the one block's c_attn
}
