// Pretrained folders (common/pretrained.hpp) and the dit node's `pretrained:`: a HunyuanDiT2DModel
// folder as diffusers' save_pretrained lays it out (config.json with its keys, the weights in
// one file or in shards with an index), alone or inside a pipeline's folder (model_index.json),
// gives the node its sizes and its weights; what is wrong is an error naming the file.
// The folders here are written by the test from flowrun's own DiT (a file saved by diffusers
// itself is issue 33's fixture work).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <tuple>

#include "formats/arrow_file.hpp"
#include "common/pretrained.hpp"
#include "common/safetensors.hpp"
#include "formats/files.hpp"
#include "formats/image_io.hpp"
#include "prep/prep_images.hpp"
#include "data_test_helpers.hpp"
#include "encode/sentencepiece.hpp"
#include "encode/text_encode.hpp"
#include "encode/tokenize.hpp"
#include "models/bert.hpp"
#include "models/dit/dit.hpp"
#include "models/t5_encoder.hpp"
#include "models/vae/vae.hpp"
#include "models/model_state.hpp"
#include "node_test_helpers.hpp"
#include "support/run_graph.hpp"

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
  const std::string e = test::graph_error(dit_graph(dir + "/one", ", depth: 3"));
  EXPECT_NE(e.find("depth is 3 in the graph, " + dir + "/one/config.json has num_layers = 2"), std::string::npos) << e;
}

TEST(Pretrained, WhatIsWrongIsAnErrorNamingTheFile) {
  const std::string dir = test::temp_dir("prebad");
  auto expect_error = [&](const std::string& folder, const std::string& want) {
    const std::string e = test::graph_error(dit_graph(folder));
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
  const std::string e = test::graph_error(dit_graph(dir + "/both", ", weights: x.safetensors"));
  EXPECT_NE(e.find("both pretrained and weights are set"), std::string::npos) << e;
}

// Issue 47: config.json values of the wrong type or range ended in nlohmann's raw type_error.302
// without file or key, 32.7 was read as 32, 1e30 became INT64_MIN in a message; a config.json
// that is a folder or /dev/zero said "unexpected end of input" (16 s for /dev/zero); a weights
// index naming a tensor twice was accepted (the last one won). One reader for every key.
TEST(Pretrained, ConfigValuesOfTheWrongTypeOrRangeAreErrorsNamingFileAndKey) {
  const std::string dir = test::temp_dir("pretype");
  struct Case {
    std::string key;
    nlohmann::json value;
    std::string want;
  } cases[] = {
      {"num_layers", "2", "key 'num_layers': expected an integer between -2147483648 and 2147483647, got \"2\""},
      {"num_layers", 32.7, "key 'num_layers': expected an integer between -2147483648 and 2147483647, got 32.7"},
      {"num_layers", 1e30, "key 'num_layers': expected an integer between -2147483648 and 2147483647, got 1e+30"},
      {"num_attention_heads", int64_t{1} << 62, "key 'num_attention_heads': expected an integer between"},
      {"mlp_ratio", "four", "key 'mlp_ratio': expected a finite number, got \"four\""},
      {"learn_sigma", "yes", "key 'learn_sigma': expected true or false, got \"yes\""},
      {"patch_size", nlohmann::json::array({2}), "key 'patch_size': expected an integer"},
  };
  int i = 0;
  for (const Case& c : cases) {
    nlohmann::json cfg = tiny_config();
    cfg[c.key] = c.value;
    const std::string folder = dir + "/c" + std::to_string(i++);
    save_folder(folder, cfg);
    const std::string e = test::graph_error(dit_graph(folder));
    EXPECT_NE(e.find(folder + "/config.json: " + c.want), std::string::npos) << c.key << "\n" << e;
  }
  // Sizes that passed the checks and ended in torch's allocator text or std::bad_alloc: every
  // parameter a config makes is counted, and absurd layer counts refused, before allocating.
  write(dir + "/vocab.txt", "[PAD]\n[UNK]\n[CLS]\n[SEP]\na\n");
  for (const auto& [key, value, want] : std::vector<std::tuple<std::string, int64_t, std::string>>{
           {"text_len", 2000000000, "parameters: "},
           {"patch_size", 100000, "parameters: "},
           {"cross_attention_dim_t5", 1000000000, "parameters: "},
           {"pooled_projection_dim", 2000000000, "parameters: "},
           {"num_layers", 1000000, "1000000 layers, more than the 10000 flowrun builds"}}) {
    nlohmann::json cfg = tiny_config();
    cfg[key] = value;
    const std::string folder = dir + "/size_" + key;
    save_folder(folder, cfg);
    const std::string e = test::graph_error(dit_graph(folder));
    EXPECT_NE(e.find("node 'model' (dit)"), std::string::npos) << key << "\n" << e;
    EXPECT_NE(e.find(want), std::string::npos) << key << "\n" << e;
  }
  const std::string deep = test::graph_error(
      "flowrun: 1\nnodes:\n  caps: { type: t_captions, with: { captions: [a] } }\n"
      "  tok: { type: wordpiece_tokenize, in: { text: caps.text }, with: { vocab: '" + dir + "/vocab.txt', max_length: 6 } }\n"
      "  bert: { type: bert_encode, in: { tokens: tok.tokens }, with: { layers: 1000000, dim: 16, heads: 2, ffn: 16 } }\n");
  EXPECT_NE(deep.find("node 'bert' (bert_encode) (bert, 1000000 layers of 16): 1000000 layers, more than"), std::string::npos) << deep;
  save_folder(dir + "/asdir", tiny_config());
  fs::remove(dir + "/asdir/config.json");
  fs::create_directories(dir + "/asdir/config.json");
  std::string e = test::graph_error(dit_graph(dir + "/asdir"));
  EXPECT_NE(e.find(dir + "/asdir/config.json: is a folder, not a JSON file"), std::string::npos) << e;
  save_folder(dir + "/zero", tiny_config());
  fs::remove(dir + "/zero/config.json");
  fs::create_symlink("/dev/zero", dir + "/zero/config.json");
  e = test::graph_error(dit_graph(dir + "/zero"));
  EXPECT_NE(e.find(dir + "/zero/config.json: not a regular file"), std::string::npos) << e;
  save_folder(dir + "/twice", tiny_config(), 2);
  const std::string index = dir + "/twice/diffusion_pytorch_model.safetensors.index.json";
  std::string text = read_file(index);
  const size_t at = text.find("\"weight_map\": {") + std::string("\"weight_map\": {").size();
  text.insert(at, "\"pos_embed.proj.weight\": \"diffusion_pytorch_model-00001-of-00002.safetensors\",");
  write(index, text);
  e = test::graph_error(dit_graph(dir + "/twice"));
  EXPECT_NE(e.find(index + ": key 'pos_embed.proj.weight' in 'weight_map' appears twice"), std::string::npos) << e;
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
  std::string e = test::graph_error(vae_graph(dir + "/pipe", ", latent_channels: 8"));
  EXPECT_NE(e.find("latent_channels is 8 in the graph, " + dir + "/pipe/vae/config.json has latent_channels = 4"), std::string::npos) << e;
  e = test::graph_error(vae_graph(dir + "/pipe", ", block_out_channels: [16, 32]"));
  EXPECT_NE(e.find("block_out_channels is [16, 32] in the graph"), std::string::npos) << e;
  nlohmann::json shifted = tiny_vae_config();
  shifted["shift_factor"] = 0.1159;
  save_vae(dir + "/shifted", shifted);
  e = test::graph_error(vae_graph(dir + "/shifted"));
  EXPECT_NE(e.find(dir + "/shifted/config.json: shift_factor = 0.1159 is not built"), std::string::npos) << e;
  e = test::graph_error(vae_graph(dir + "/pipe", ", weights: x.safetensors"));
  EXPECT_NE(e.find("both pretrained and weights are set"), std::string::npos) << e;
}

// ---- the text encoders and their tokenizers: transformers folders, alone or in a pipeline ----

// BertConfig.to_json_string() of a tiny BERT (every key transformers 4.x writes).
nlohmann::json tiny_bert_config() {
  return nlohmann::json::parse(R"({
    "architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "classifier_dropout": null,
    "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 16, "initializer_range": 0.02,
    "intermediate_size": 32, "layer_norm_eps": 1e-12, "max_position_embeddings": 12, "model_type": "bert",
    "num_attention_heads": 2, "num_hidden_layers": 2, "pad_token_id": 0, "position_embedding_type": "absolute",
    "torch_dtype": "float32", "transformers_version": "4.44.2", "type_vocab_size": 2, "use_cache": true,
    "vocab_size": 20})");
}

// MT5Config of a tiny mT5 encoder (the keys of T5EncoderModel.save_pretrained).
nlohmann::json tiny_mt5_config() {
  return nlohmann::json::parse(R"({
    "architectures": ["T5EncoderModel"], "classifier_dropout": 0.0, "d_ff": 24, "d_kv": 8, "d_model": 16,
    "decoder_start_token_id": 0, "dense_act_fn": "gelu_new", "dropout_rate": 0.1, "eos_token_id": 1,
    "feed_forward_proj": "gated-gelu", "initializer_factor": 1.0, "is_encoder_decoder": true, "is_gated_act": true,
    "layer_norm_epsilon": 1e-06, "model_type": "mt5", "num_decoder_layers": 2, "num_heads": 2, "num_layers": 2,
    "pad_token_id": 0, "relative_attention_max_distance": 128, "relative_attention_num_buckets": 32,
    "tie_word_embeddings": false, "tokenizer_class": "T5Tokenizer", "torch_dtype": "float32",
    "transformers_version": "4.44.2", "use_cache": true, "vocab_size": 20})");
}

template <class M>
safetensors::Tensors weights_of(M& m) {
  safetensors::Tensors out;
  for (const auto& item : m->named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

// A transformers folder: config.json and model.safetensors, or `shards` shards and their index.
void save_transformers(const std::string& dir, const nlohmann::json& config, const safetensors::Tensors& w, int shards = 1) {
  write(dir + "/config.json", config.dump(2));
  if (shards == 1) return safetensors::save(dir + "/model.safetensors", w);
  std::vector<safetensors::Tensors> parts(static_cast<size_t>(shards));
  nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
  auto file = [&](size_t k) { return "model-0000" + std::to_string(k + 1) + "-of-0000" + std::to_string(shards) + ".safetensors"; };
  size_t i = 0;
  for (const auto& [name, t] : w) {
    const size_t k = i++ % parts.size();
    parts[k][name] = t;
    index["weight_map"][name] = file(k);
  }
  for (size_t k = 0; k < parts.size(); ++k) safetensors::save(dir + "/" + file(k), parts[k]);
  write(dir + "/model.safetensors.index.json", index.dump(2));
}

// A HunyuanDiT-like pipeline folder: text_encoder/ (BERT, one file), text_encoder_2/ (mT5
// encoder, two shards), tokenizer/ (vocab.txt, do_lower_case false), tokenizer_2/.
struct TinyPipeline {
  std::string dir;
  safetensors::Tensors bert, mt5;
};
TinyPipeline save_text_pipeline(const std::string& dir) {
  TinyPipeline p{dir, {}, {}};
  bert::Config bc;
  bc.vocab = 20, bc.dim = 16, bc.layers = 2, bc.heads = 2, bc.ffn = 32, bc.max_positions = 12;
  bert::Bert b(bc);
  bert::init_weights(*b, 3);
  p.bert = weights_of(b);
  safetensors::Tensors with_pooler = p.bert;  // transformers saves BertModel's pooler too
  with_pooler["pooler.dense.weight"] = torch::zeros({16, 16});
  save_transformers(dir + "/text_encoder", tiny_bert_config(), with_pooler);
  t5::Config tc;
  tc.vocab = 20, tc.dim = 16, tc.d_kv = 8, tc.ffn = 24, tc.layers = 2, tc.heads = 2;
  t5::T5Encoder t(tc);
  t5::init_weights(*t, 4);
  p.mt5 = weights_of(t);
  save_transformers(dir + "/text_encoder_2", tiny_mt5_config(), p.mt5, 2);
  write(dir + "/tokenizer/vocab.txt", "[PAD]\n[UNK]\n[CLS]\n[SEP]\na\nCat\nsat\n");
  write(dir + "/tokenizer/tokenizer_config.json", R"({"do_lower_case": false, "model_max_length": 512})");
  write(dir + "/tokenizer_2/spiece.model", "not read here");
  write(dir + "/model_index.json", R"({"_class_name": "HunyuanDiTPipeline", "text_encoder": ["transformers", "BertModel"],
    "text_encoder_2": ["transformers", "T5EncoderModel"], "tokenizer": ["transformers", "BertTokenizer"],
    "tokenizer_2": ["transformers", "T5Tokenizer"]})");
  return p;
}

// The pipeline's tokenizer feeding both encoders (the tiny vocabulary's ids fit both).
std::string encoders_graph(const std::string& bert, const std::string& t5, const std::string& more = "",
                           const std::string& vocab = "") {
  return "flowrun: 1\nrun: { steps: 1, seed: 1 }\nnodes:\n"
         "  caps: { type: t_captions, with: { captions: [a Cat sat] } }\n"
         "  tok: { type: wordpiece_tokenize, in: { text: caps.text }, with: { vocab: '" + (vocab.empty() ? bert : vocab) +
         "', max_length: 6 } }\n"
         "  bert: { type: bert_encode, in: { tokens: tok.tokens }, with: { pretrained: '" + bert + "'" + more + " } }\n"
         "  t5: { type: t5_encode, in: { tokens: tok.tokens }, with: { pretrained: '" + t5 + "', out_prefix: t5 } }\n";
}

void expect_weights(ModelState& m, const safetensors::Tensors& want, const std::string& what) {
  size_t n = 0;
  for (const auto& [name, t] : m.named_parameters()) {
    ASSERT_TRUE(want.count(name)) << what << ": " << name;
    EXPECT_TRUE(torch::equal(t, want.at(name))) << what << ": " << name;
    ++n;
  }
  EXPECT_EQ(n, want.size()) << what;
}

TEST(Pretrained, TextEncodersTakeTheirSizesAndWeightsFromTransformersFolders) {
  const TinyPipeline p = save_text_pipeline(test::temp_dir("pretext") + "/pipe");
  // The pipeline's folder (each node reads its component), or each component's own folder.
  for (auto [bert, t5] : {std::pair{p.dir, p.dir}, std::pair{p.dir + "/text_encoder", p.dir + "/text_encoder_2"}}) {
    auto g = test::load_graph_text(encoders_graph(bert, t5, "", p.dir));
    expect_weights(g->state<ModelState>("bert", "params"), p.bert, bert);
    expect_weights(g->state<ModelState>("t5", "params"), p.mt5, t5);
    // The encoders run at the folder's sizes: [1, 5] ids -> [1, 5, 16].
    const TensorMap emb = encode_text(g->state<ModelState>("t5", "params"), {{"input_ids", torch::tensor({{4, 5, 6, 7, 1}})}});
    EXPECT_EQ(emb.at("t5_emb").sizes().vec(), (std::vector<int64_t>{1, 5, 16}));
  }
  // Sizes also written in the graph must agree with config.json.
  EXPECT_NO_THROW(test::load_graph_text(encoders_graph(p.dir, p.dir, ", dim: 16, layers: 2")));
  const std::string e = test::graph_error(encoders_graph(p.dir, p.dir, ", layers: 12"));
  EXPECT_NE(e.find("'bert'"), std::string::npos) << e;
  EXPECT_NE(e.find("layers is 12 in the graph, " + p.dir + "/text_encoder/config.json has num_hidden_layers = 2"),
            std::string::npos) << e;
}

TEST(Pretrained, ATextEncoderFolderItCannotComputeIsAnErrorNamingTheFile) {
  const std::string dir = test::temp_dir("pretextbad");
  const TinyPipeline p = save_text_pipeline(dir + "/pipe");
  auto bert_error = [&](const nlohmann::json& config, const std::string& want) {
    save_transformers(dir + "/bert", config, p.bert);
    const std::string e = test::graph_error(encoders_graph(dir + "/bert", p.dir, "", p.dir));
    EXPECT_NE(e.find(want), std::string::npos) << "wanted: " << want << "\ngot: " << e;
  };
  nlohmann::json c = tiny_bert_config();
  c["model_type"] = "roberta";
  bert_error(c, dir + "/bert/config.json: model_type is roberta; bert_encode reads a BERT");
  c = tiny_bert_config();
  c["position_embedding_type"] = "relative_key";
  bert_error(c, dir + "/bert/config.json: position_embedding_type = relative_key is not built");
  c = tiny_bert_config();
  c["use_rotary"] = true;
  bert_error(c, dir + "/bert/config.json: use_rotary is not a BertModel setting this BERT knows");
  auto t5_error = [&](const nlohmann::json& config, const std::string& want) {
    save_transformers(dir + "/t5", config, p.mt5);
    const std::string e = test::graph_error(encoders_graph(p.dir, dir + "/t5"));
    EXPECT_NE(e.find(want), std::string::npos) << "wanted: " << want << "\ngot: " << e;
  };
  c = tiny_mt5_config();
  c["model_type"] = "umt5";
  t5_error(c, "model_type is umt5; t5_encode reads a T5 or an mT5");
  c = tiny_mt5_config();
  c["dense_act_fn"] = "relu";
  t5_error(c, dir + "/t5/config.json: dense_act_fn = relu is not built (this encoder computes with gelu_new)");
  c = tiny_mt5_config();
  c["feed_forward_proj"] = "gated-silu";
  t5_error(c, "feed_forward_proj = gated-silu is not built");
  const std::string e = test::graph_error(encoders_graph(p.dir, p.dir, ", weights: x.safetensors"));
  EXPECT_NE(e.find("'bert' (bert_encode): both pretrained and weights are set"), std::string::npos) << "got: " << e;
}

TEST(Pretrained, TokenizersFindTheirFileInATokenizerOrPipelineFolder) {
  const TinyPipeline p = save_text_pipeline(test::temp_dir("pretok") + "/pipe");
  std::string folder;
  EXPECT_EQ(tokenizer_file(p.dir, {"vocab.txt", "tokenizer"}, &folder), p.dir + "/tokenizer/vocab.txt");
  EXPECT_EQ(folder, p.dir + "/tokenizer");
  EXPECT_EQ(tokenizer_file(p.dir, {"spiece.model", "tokenizer_2"}, &folder), p.dir + "/tokenizer_2/spiece.model");
  EXPECT_EQ(tokenizer_file(p.dir + "/tokenizer_2", {"spiece.model", "tokenizer_2"}, &folder), p.dir + "/tokenizer_2/spiece.model");
  EXPECT_EQ(tokenizer_file("a/vocab.txt", {"vocab.txt", "tokenizer"}, &folder), "a/vocab.txt");
  EXPECT_EQ(folder, "");
  try {
    tokenizer_file(p.dir + "/text_encoder", {"vocab.txt", "tokenizer"}, nullptr);
    ADD_FAILURE() << "a folder without vocab.txt was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(p.dir + "/text_encoder has no vocab.txt"), std::string::npos) << e.what();
  }
  // The wordpiece node from the pipeline's folder takes do_lower_case from tokenizer_config.json
  // ("Cat" stays a word); a lowercase written in the graph must agree.
  auto graph = [&](const std::string& more) {
    return "flowrun: 1\nrun: { steps: 1 }\nnodes:\n  caps: { type: t_captions, with: { captions: [a Cat sat] } }\n"
           "  tok: { type: wordpiece_tokenize, in: { text: caps.text }, with: { vocab: '" + p.dir + "', max_length: 6" + more +
           " } }\n";
  };
  auto g = test::load_graph_text(graph(""));
  const TensorMap ids = encode_texts(g->state<TextTokenizer>("tok", "tokenizer"), {"a Cat sat"});
  EXPECT_TRUE(torch::equal(ids.at("input_ids"), torch::tensor({{2, 4, 5, 6, 3, 0}}))) << ids.at("input_ids");
  const std::string e = test::graph_error(graph(", lowercase: true"));
  EXPECT_NE(e.find("lowercase is true in the graph, " + p.dir + "/tokenizer/tokenizer_config.json has do_lower_case = false"),
            std::string::npos) << e;
  // Issue 47: do_lower_case: "yes" was ignored; a value that is not a bool is refused.
  write(p.dir + "/tokenizer/tokenizer_config.json", R"({"do_lower_case": "yes"})");
  const std::string yes = test::graph_error(graph(""));
  EXPECT_NE(yes.find(p.dir + "/tokenizer/tokenizer_config.json: key 'do_lower_case': expected true or false, got \"yes\""),
            std::string::npos) << yes;
}

// ---- graphs/hydit_v12_lora.yaml on a tiny pipeline: every component from one folder ----

// A tiny HunyuanDiT pipeline as HunyuanDiT-v1.2-Diffusers lays it out: transformer/ (the DiT of
// tiny_config: BERT width 16, mT5 width 24, text lengths 8), vae/, text_encoder/ (BERT),
// text_encoder_2/ (mT5 encoder, vocabulary 40, two shards), tokenizer/ and tokenizer_2/ (a
// SentencePiece model of 40 pieces trained here).
std::string save_hydit_pipeline(const std::string& dir) {
  // A trained checkpoint has no zero layers (the DiT's init zeroes its output and modulation,
  // through which no gradient would reach the adapters): the init plus noise.
  write(dir + "/transformer/config.json", tiny_config().dump(2));
  safetensors::Tensors w = tiny_weights();
  at::Generator g = at::detail::createCPUGenerator(9);
  for (auto& [name, t] : w)
    if (t.is_floating_point()) t = t + 0.05 * torch::randn(t.sizes(), g);
  safetensors::save(dir + "/transformer/diffusion_pytorch_model.safetensors", w);
  save_vae(dir + "/vae", tiny_vae_config());
  bert::Config bc;
  bc.vocab = 20, bc.dim = 16, bc.layers = 2, bc.heads = 2, bc.ffn = 32, bc.max_positions = 12;
  bert::Bert b(bc);
  bert::init_weights(*b, 3);
  save_transformers(dir + "/text_encoder", tiny_bert_config(), weights_of(b));
  nlohmann::json mc = tiny_mt5_config();
  mc["d_model"] = 24, mc["vocab_size"] = 40;
  t5::Config tc;
  tc.vocab = 40, tc.dim = 24, tc.d_kv = 8, tc.ffn = 24, tc.layers = 2, tc.heads = 2;
  t5::T5Encoder t(tc);
  t5::init_weights(*t, 4);
  save_transformers(dir + "/text_encoder_2", mc, weights_of(t), 2);
  write(dir + "/tokenizer/vocab.txt", "[PAD]\n[UNK]\n[CLS]\n[SEP]\na\nred\nblue\nsquare\ncircle\n");
  write(dir + "/tokenizer/tokenizer_config.json", R"({"do_lower_case": true})");
  {
    std::ofstream out(dir + "/corpus.txt");
    const std::vector<std::string> words = {"a", "red", "blue", "green", "square", "circle", "on", "under", "the",
                                            "small", "large", "field", "sky", "over", "bird", "house"};
    std::mt19937 rng(1);
    for (int i = 0; i < 400; ++i) {
      for (int j = 0; j < 8; ++j) out << (j ? " " : "") << words[rng() % words.size()];
      out << "\n";
    }
  }
  fs::create_directories(dir + "/tokenizer_2");
  SentencePieceTokenizer::train(dir + "/corpus.txt", dir + "/tokenizer_2/spiece", 40);
  write(dir + "/model_index.json", R"({"_class_name": "HunyuanDiTPipeline", "transformer": ["diffusers", "HunyuanDiT2DModel"],
    "vae": ["diffusers", "AutoencoderKL"], "text_encoder": ["transformers", "BertModel"],
    "text_encoder_2": ["transformers", "T5EncoderModel"], "tokenizer": ["transformers", "BertTokenizer"],
    "tokenizer_2": ["transformers", "T5Tokenizer"]})");
  return dir;
}

// The losses a run logged, each checked finite.
int finite_losses(const test::RunResult& run) {
  int losses = 0;
  for (const auto& j : run.metrics)
    if (j.contains("loss")) {
      ++losses;
      EXPECT_TRUE(std::isfinite(j["loss"].get<double>()));
    }
  return losses;
}

// graphs/hydit_v12_lora.yaml itself, with the pipeline and the data by its two variables and
// the sizes by overrides: it trains the adapters on images of two sizes in buckets with both
// text streams, exports them in PEFT's layout, samples with both encoders, and the dit's
// `adapters:` loads the export back.
TEST(Pretrained, HunyuanDitV12GraphTrainsAdaptersOnATinyPipeline) {
  if (!sentencepiece_available()) GTEST_SKIP() << "built without libsentencepiece-dev (the mT5 tokenizer)";
  const std::string dir = test::temp_dir("hydit12");
  const std::string pipe = save_hydit_pipeline(dir + "/pipe");
  fs::create_directories(dir + "/src");
  for (int i = 0; i < 12; ++i) {  // 32x32 and 48x32 images
    const int w = i % 2 ? 48 : 32;
    write_png(dir + "/src/" + std::to_string(100 + i) + ".png", resize(test::gradient(8, 8), w, 32));
    test::write_text(dir + "/src/" + std::to_string(100 + i) + ".txt", i % 2 ? "a red square" : "a blue circle");
  }
  PrepImagesOptions po;
  po.dir = dir + "/src", po.out = dir + "/data", po.val_fraction = 0, po.quiet = true;
  prep_images(po);
  ::setenv("HYDIT", pipe.c_str(), 1);
  ::setenv("HYDIT_DATA", po.out.c_str(), 1);
  const std::string src = FLOWRUN_SOURCE_DIR;
  const std::string graph = test::read_text(src + "/graphs/hydit_v12_lora.yaml");
  const std::vector<std::string> tiny = {"run.steps=4", "run.precision=fp32", "run.log_every=2", "data.size=32",
                                         "data.bucket_step=16", "data.batch=2", "tok.max_length=8", "tok5.max_length=8",
                                         "sample.every=4", "sample.steps=2", "sample.height=16", "sample.width=16",
                                         "ckpt.every=4", "model.lora.rank=4", "model.lora.alpha=4"};
  auto run = test::run_graph_text(graph, tiny);
  ::unsetenv("HYDIT");
  ::unsetenv("HYDIT_DATA");
  const int losses = finite_losses(run);
  EXPECT_EQ(losses, 2);
  EXPECT_TRUE(fs::exists(run.out_dir + "/samples/step_0000004.png"));
  const std::string peft = run.out_dir + "/checkpoints/step_00000004";  // one state with adapters: in the step folder
  ASSERT_TRUE(fs::exists(peft + "/adapter_model.safetensors"));
  ASSERT_TRUE(fs::exists(peft + "/adapter_config.json"));
  const safetensors::Tensors exported = safetensors::load(peft + "/adapter_model.safetensors").tensors;
  EXPECT_FALSE(exported.empty());
  // The export loads back through the dit's adapters (PEFT names -> the model's).
  const std::string again = "flowrun: 1\nrun: { steps: 1 }\nnodes:\n  model: { type: dit, with: { pretrained: '" + pipe +
                            "', adapters: '" + peft + "' } }\n";
  auto g = test::load_graph_text(again);
  ModelState& m = g->state<ModelState>("model", "params");
  size_t lora = 0;
  for (const auto& [name, t] : m.named_parameters())
    if (name.find("lora_B") != std::string::npos) {
      ++lora;
      EXPECT_TRUE(t.requires_grad()) << name;
    }
  EXPECT_GT(lora, 0u);
  double moved = 0;  // B starts at zero: the trained adapters are not
  for (const auto& [name, t] : exported)
    if (name.find("lora_B") != std::string::npos) moved += t.abs().sum().item<double>();
  EXPECT_GT(moved, 0);
}

// The same graph on HunyuanDiT's own data layout by one override: Arrow files from its
// csv2arrow.py under a multi-resolution index from IndexKits' `idk multireso`
// (tests/fixtures/arrow/), trained in the index's buckets (data.buckets=index).
TEST(Pretrained, HunyuanDitV12GraphTrainsFromAnIndexKitsMultiResolutionIndex) {
  if (!sentencepiece_available()) GTEST_SKIP() << "built without libsentencepiece-dev (the mT5 tokenizer)";
  if (!arrow_available()) GTEST_SKIP() << arrow_missing_message();
  const std::string dir = test::temp_dir("hydit12arrow");
  const std::string pipe = save_hydit_pipeline(dir + "/pipe");
  const std::string src = FLOWRUN_SOURCE_DIR;
  ::setenv("HYDIT", pipe.c_str(), 1);
  ::setenv("HYDIT_DATA", (src + "/tests/fixtures/arrow/index_multireso.json").c_str(), 1);
  const std::vector<std::string> tiny = {"run.steps=3", "run.precision=fp32", "run.log_every=1", "data.buckets=index", "data.batch=2",
                                         "tok.max_length=8", "tok5.max_length=8", "sample.every=1000", "sample.at=[]", "ckpt.every=3",
                                         "model.lora.rank=4", "model.lora.alpha=4"};
  auto run = test::run_graph_text(test::read_text(src + "/graphs/hydit_v12_lora.yaml"), tiny);
  ::unsetenv("HYDIT");
  ::unsetenv("HYDIT_DATA");
  const int losses = finite_losses(run);
  EXPECT_EQ(losses, 3);
  EXPECT_TRUE(fs::exists(run.out_dir + "/checkpoints/step_00000003/adapter_model.safetensors"));
}

// The evaluator and the sampler pair tokenizers with encoders in the order written.
TEST(Pretrained, TokenizersAndEncodersPairOneToOne) {
  const TinyPipeline p = save_text_pipeline(test::temp_dir("pairs") + "/pipe");
  const std::string yaml = "flowrun: 1\nrun: { steps: 1 }\nnodes:\n  caps: { type: t_captions, with: { captions: [a Cat sat] } }\n"
                           "  tok: { type: wordpiece_tokenize, in: { text: caps.text }, with: { vocab: '" + p.dir + "', max_length: 6 } }\n"
                           "  bert: { type: bert_encode, in: { tokens: tok.tokens }, with: { pretrained: '" + p.dir + "' } }\n"
                           "  t5: { type: t5_encode, in: { tokens: tok.tokens }, with: { pretrained: '" + p.dir + "', out_prefix: t5 } }\n"
                           "  loss: { type: diffusion_loss }\n"
                           "  model: { type: mlp, with: { in_dim: 4, hidden: 4, layers: 1, out_dim: 4 } }\n"
                           "  sample: { type: sampler, in: { objective: loss.objective, model: model.params, tokenizer: tok.tokenizer,\n"
                           "            encoder: [bert.params, t5.params] }, with: { prompts: [a] } }\n";
  const std::string e = test::graph_error(yaml);
  EXPECT_NE(e.find("1 tokenizer(s) [tok.tokenizer] and 2 encoder(s) [bert.params, t5.params]: give one tokenizer per encoder"),
            std::string::npos) << e;
}

// Issue 47: a tokenizer with more ids than its encoder's embedding (a vocab.txt of 101 words for
// a BERT of 72) started, and step 1 failed in the embedding, naming neither file.
TEST(Pretrained, ATokenizerLargerThanItsEncoderIsRefusedAtSetup) {
  const TinyPipeline p = save_text_pipeline(test::temp_dir("bigtok") + "/pipe");  // BERT vocab_size 20
  std::string words = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n";
  for (int i = 0; i < 30; ++i) words += "w" + std::to_string(i) + "\n";
  write(p.dir + "/big/vocab.txt", words);
  auto yaml = [&](const std::string& vocab) {
    return "flowrun: 1\nrun: { steps: 1 }\nnodes:\n  caps: { type: t_captions, with: { captions: [a Cat sat] } }\n"
           "  tok: { type: wordpiece_tokenize, in: { text: caps.text }, with: { vocab: '" + vocab + "', max_length: 6 } }\n"
           "  bert: { type: bert_encode, in: { tokens: tok.tokens }, with: { pretrained: '" + p.dir + "' } }\n";
  };
  EXPECT_NO_THROW(test::load_graph_text(yaml(p.dir)));
  const std::string e = test::graph_error(yaml(p.dir + "/big/vocab.txt"));
  EXPECT_NE(e.find("node 'bert' (bert_encode): its tokens come from 'tok', whose wordpiece tokenizer (" + p.dir +
                   "/big/vocab.txt) has 34 ids, more than the 20 rows of this encoder's token embedding (" + p.dir +
                   "/text_encoder/config.json)"),
            std::string::npos) << e;
}

}  // namespace
}  // namespace flowrun
