// Parity with the reference libraries on files they wrote themselves: tests/fixtures/hf/ holds a
// tiny HunyuanDiT2DModel (8 shards and an index) and AutoencoderKL saved by diffusers v0.30.3's
// save_pretrained, and their outputs for fixed inputs (tests/fixtures/hf/make_fixtures.py).
// flowrun loads each folder by `pretrained:`, as a user's graph does, and must give the same
// outputs: the DiT with the pipeline's RoPE positions (rope_base_grid 32, the default), both
// text streams with padded prompts, size/style conditioning and the learned-sigma channels;
// the VAE's posterior and its decoder.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "common/pretrained.hpp"
#include "common/safetensors.hpp"
#include "encode/text_encode.hpp"
#include "models/dit/dit.hpp"
#include "models/gpt/gpt.hpp"
#include "models/model_state.hpp"
#include "models/vae/vae.hpp"
#include "hf_fixture_helpers.hpp"
#include "node_test_helpers.hpp"

namespace flowrun {
namespace {

const std::string kFixtures = std::string(FLOWRUN_SOURCE_DIR) + "/tests/fixtures/hf";

const safetensors::Tensors& reference() {
  static const safetensors::Tensors r = safetensors::load(kFixtures + "/reference.safetensors").tensors;
  return r;
}
const torch::Tensor& ref(const std::string& name) { return reference().at(name); }

double rel(const torch::Tensor& a, const torch::Tensor& b) { return test::rel_norm_diff(a, b); }  // the parity bars' measure

// The fixture's DiT through the dit node (`more`: extra parameters), on the stored inputs.
torch::Tensor dit_output(const std::string& more = "") {
  auto g = test::load_graph_text("flowrun: 1\nrun: { steps: 1 }\nnodes:\n  model: { type: dit, with: { pretrained: '" +
                                 kFixtures + "/hunyuandit'" + more + " } }\n");
  auto dit = std::dynamic_pointer_cast<dit::DitImpl>(g->state<ModelState>("model", "params").module);
  EXPECT_TRUE(dit);
  dit->eval();
  dit::DitImpl::Inputs in;
  in.x = ref("dit.x");
  in.t = ref("dit.t");
  in.text = ref("dit.text");
  in.text_mask = ref("dit.text_mask").to(torch::kLong);
  in.t5 = ref("dit.t5");
  in.t5_mask = ref("dit.t5_mask").to(torch::kLong);
  in.image_meta_size = ref("dit.image_meta_size");
  in.style = ref("dit.style").to(torch::kLong);
  torch::NoGradGuard ng;
  return dit->forward(in);
}

TEST(HfFixtures, HunyuanDitFromItsShardedDiffusersFolderMatchesDiffusersForward) {
  const torch::Tensor out = dit_output();
  ASSERT_EQ(out.sizes(), ref("dit.out").sizes());  // the prediction and the variance channels
  EXPECT_LT(rel(out, ref("dit.out")), 1e-5) << rel(out, ref("dit.out"));
  std::printf("HunyuanDiT vs diffusers: %.2e relative\n", rel(out, ref("dit.out")));
  EXPECT_LT(rel(out[1], ref("dit.out")[1]), 1e-5);  // the row of the padded prompts alone
  // The bar can fail: integer RoPE positions (not the pipeline's) give another output.
  EXPECT_GT(rel(dit_output(", rope_base_grid: null"), ref("dit.out")), 1e-4);  // measured 7.3e-4
}

TEST(HfFixtures, VaeFromItsDiffusersFolderMatchesDiffusersEncodeAndDecode) {
  auto g = test::load_graph_text("flowrun: 1\nrun: { steps: 1 }\nnodes:\n  model: { type: vae, with: { pretrained: '" +
                                 kFixtures + "/vae' } }\n");
  auto& state = static_cast<vae::VaeState&>(g->state<ModelState>("model", "params"));
  EXPECT_DOUBLE_EQ(state.config.scaling_factor, 0.13025);
  vae::AutoencoderKLImpl& m = state.vae();
  m.eval();
  torch::NoGradGuard ng;
  const auto [mean, logvar] = m.encode(ref("vae.images"));
  EXPECT_LT(rel(mean, ref("vae.mean")), 1e-5);
  EXPECT_LT(rel(logvar, ref("vae.logvar")), 1e-5);
  const torch::Tensor decoded = m.decode(ref("vae.mean"));
  EXPECT_LT(rel(decoded, ref("vae.decoded")), 1e-5);
  std::printf("AutoencoderKL vs diffusers: mean %.2e, logvar %.2e, decoded %.2e relative\n", rel(mean, ref("vae.mean")),
              rel(logvar, ref("vae.logvar")), rel(decoded, ref("vae.decoded")));
}

// tests/fixtures/hf/make_transformers_fixtures.py's outputs: inputs (ids and masks as float32)
// and transformers' outputs for them, by model (bert.*, t5.*, mt5.*, gpt2.*).
const safetensors::Tensors& transformers_reference() {
  static const safetensors::Tensors r = safetensors::load(kFixtures + "/reference_transformers.safetensors").tensors;
  return r;
}
const torch::Tensor& tref(const std::string& name) { return transformers_reference().at(name); }

// The wordpiece tokenizer's vocabulary an encoder node's `tokens` input needs in a graph (the
// tests then give the encoder the stored ids themselves).
const std::string& tokenizer_vocab() {
  static const std::string path = [] {
    const std::string p = test::temp_dir("hf_transformers") + "/vocab.txt";
    std::ofstream(p) << "[PAD]\n[UNK]\n[CLS]\n[SEP]\na\n";
    return p;
  }();
  return path;
}

// The encoder node `type` (bert_encode, t5_encode) loaded by `pretrained:` from the fixture
// folder `folder`, as a user's graph does, on the CPU; encode_text on the stored ids and mask of
// `key` (bert, t5, mt5): {text_emb, text_mask}.
TensorMap encoder_output(const std::string& type, const std::string& folder, const std::string& key) {
  auto g = test::load_graph_text(
      "flowrun: 1\nrun: { steps: 1, device: cpu }\nnodes:\n"
      "  caps: { type: t_captions, with: { captions: [a] } }\n"
      "  tok: { type: wordpiece_tokenize, in: { text: caps.text }, with: { vocab: '" +
      tokenizer_vocab() + "', max_length: 8 } }\n"
      "  enc: { type: " + type + ", in: { tokens: tok.tokens }, with: { pretrained: '" + kFixtures + "/" + folder +
      "' } }\n");
  ModelState& enc = g->state<ModelState>("enc", "params");
  return encode_text(enc, {{"input_ids", tref(key + ".input_ids").to(torch::kLong)},
                           {"attention_mask", tref(key + ".attention_mask").to(torch::kLong)}});
}

// The emb of `key`'s encoder against transformers' last_hidden_state: every position (padded
// ones are computed, not zeroed, in both), the padded row alone, and the mask passed through.
void expect_encoder_matches(const TensorMap& out, const std::string& key, const char* what) {
  const torch::Tensor& want = tref(key + ".last_hidden_state");
  const torch::Tensor& emb = out.at("text_emb");
  ASSERT_EQ(emb.sizes(), want.sizes()) << what;
  EXPECT_EQ(emb.scalar_type(), torch::kFloat) << what;
  EXPECT_LT(rel(emb, want), 1e-5) << what << ": " << rel(emb, want);
  EXPECT_LT(rel(emb[1], want[1]), 1e-5) << what << " (the padded row): " << rel(emb[1], want[1]);
  EXPECT_TRUE(torch::equal(out.at("text_mask"), tref(key + ".attention_mask").to(torch::kLong))) << what;
  std::printf("%s vs transformers: %.2e relative (padded row %.2e)\n", what, rel(emb, want), rel(emb[1], want[1]));
}

TEST(HfFixtures, BertEncodeFromATransformersBertModelFolderMatchesTransformersLastHiddenState) {
  expect_encoder_matches(encoder_output("bert_encode", "bert", "bert"), "bert", "BertModel");
}

TEST(HfFixtures, T5EncodeFromATransformersT5V11EncoderFolderMatchesTransformersLastHiddenState) {
  expect_encoder_matches(encoder_output("t5_encode", "t5", "t5"), "t5", "T5EncoderModel (v1.1)");
}

TEST(HfFixtures, T5EncodeFromAShardedTransformersMt5EncoderFolderMatchesTransformersLastHiddenState) {
  // The folder is as transformers sharded it: an index and at least two shards, no single file.
  const PretrainedFolder f = open_pretrained(kFixtures + "/mt5", {"text_encoder_2", "", "model"});
  EXPECT_EQ(f.weights_index, kFixtures + "/mt5/model.safetensors.index.json");
  EXPECT_GE(f.weight_files.size(), 2u);
  EXPECT_EQ(f.config.value("model_type", ""), "mt5");
  expect_encoder_matches(encoder_output("t5_encode", "mt5", "mt5"), "mt5", "MT5EncoderModel (sharded)");
}

TEST(HfFixtures, GptFromATransformersGpt2ModelSafetensorsMatchesTransformersLogits) {
  // `weights:` names transformers' model.safetensors ("transformer." names, no lm_head.weight:
  // tied) and the graph writes the sizes of gpt2/config.json (n_layer, n_embd, n_head,
  // vocab_size, n_positions); `pretrained:` (below) reads them from the folder.
  auto g = test::load_graph_text(
      "flowrun: 1\nrun: { steps: 1, device: cpu }\nnodes:\n"
      "  model: { type: gpt, with: { layers: 2, dim: 16, heads: 2, vocab: 80, context: 32, weights: '" + kFixtures +
      "/gpt2/model.safetensors' } }\n");
  ModelState& s = g->state<ModelState>("model", "params");
  auto gpt = std::dynamic_pointer_cast<gpt::GptImpl>(s.module);
  ASSERT_TRUE(gpt);
  gpt->eval();
  torch::NoGradGuard ng;
  const torch::Tensor ids = tref("gpt2.input_ids").to(torch::kLong);
  const torch::Tensor& want = tref("gpt2.logits");  // transformers' logits without a mask
  const torch::Tensor logits = gpt->forward(ids);
  ASSERT_EQ(logits.sizes(), want.sizes());
  EXPECT_LT(rel(logits, want), 1e-5) << rel(logits, want);
  // The second row is padded on the right (with the eos token, read as tokens here and by
  // transformers alike); its real positions alone, which a mask would not change.
  const torch::Tensor real = tref("gpt2.attention_mask")[1].to(torch::kBool);
  EXPECT_LT(rel(logits[1].index({real}), want[1].index({real})), 1e-5);
  // Through the node's forward: tokens [B, T+1] give the logits of tokens[:, :-1].
  const torch::Tensor tokens = torch::cat({ids, ids.narrow(1, 0, 1)}, 1);
  EXPECT_LT(rel(s.forward({{"tokens", tokens}}), want), 1e-5);
  std::printf("GPT2LMHeadModel vs transformers: %.2e relative\n", rel(logits, want));
}

TEST(HfFixtures, GptFromItsTransformersFolderByPretrainedTakesTheSizesFromConfigJson) {
  // gpt2/ as save_pretrained wrote it: no size in the graph, the same logits.
  auto g = test::load_graph_text("flowrun: 1\nrun: { steps: 1, device: cpu }\nnodes:\n  model: { type: gpt, with: { pretrained: '" +
                                 kFixtures + "/gpt2' } }\n");
  ModelState& s = g->state<ModelState>("model", "params");
  auto gpt = std::dynamic_pointer_cast<gpt::GptImpl>(s.module);
  ASSERT_TRUE(gpt);
  EXPECT_EQ(describe(gpt->config()), "layers=2 dim=16 heads=2 vocab=80 context=32");
  gpt->eval();
  torch::NoGradGuard ng;
  EXPECT_LT(rel(gpt->forward(tref("gpt2.input_ids").to(torch::kLong)), tref("gpt2.logits")), 1e-5);

  // A size the graph writes must agree with the folder's; a key that changes the math is refused
  // by name, every problem at once.
  const std::string sizes = test::graph_error("flowrun: 1\nrun: { steps: 1 }\nnodes:\n  model: { type: gpt, with: { pretrained: '" +
                                              kFixtures + "/gpt2', layers: 3 } }\n");
  EXPECT_NE(sizes.find("layers is 3 in the graph, " + kFixtures + "/gpt2/config.json has n_layer = 2"), std::string::npos)
      << sizes;
  const std::string dir = test::temp_dir("gpt-pretrained") + "/gpt2";
  std::filesystem::copy(kFixtures + "/gpt2", dir, std::filesystem::copy_options::recursive);
  nlohmann::json c;
  std::ifstream(dir + "/config.json") >> c;
  c["activation_function"] = "relu";
  c["n_inner"] = 48;
  std::ofstream(dir + "/config.json") << c.dump(2);
  const std::string e = test::graph_error("flowrun: 1\nrun: { steps: 1 }\nnodes:\n  model: { type: gpt, with: { pretrained: '" +
                                          dir + "' } }\n");
  EXPECT_NE(e.find("node 'model' (gpt)"), std::string::npos) << e;
  EXPECT_NE(e.find("2 problems"), std::string::npos) << e;
  EXPECT_NE(e.find("activation_function"), std::string::npos) << e;
  EXPECT_NE(e.find("n_inner = 48 is not built"), std::string::npos) << e;
}

// Saving back: a gpt checkpoint's `exports` writes a GPT2LMHeadModel folder (config.json with the
// sizes, the weights under transformer.*, the tokenizer files and token ids of the folder it came
// from), which this node reads back as the same model, bit for bit, sharded or not.
// (tests/cli/hf_export_check.py loads it in transformers.)
TEST(HfFixtures, GptSavesBackAFolderOfGpt2LMHeadModelThatReadsBackAsTheSameModel) {
  const std::string graph = "flowrun: 1\nrun: { steps: 1, device: cpu }\nnodes:\n  model: { type: gpt, with: { pretrained: '" +
                            kFixtures + "/gpt2', export_shard_mb: 0.004 } }\n";
  auto g = test::load_graph_text(graph);
  ModelState& s = g->state<ModelState>("model", "params");
  ASSERT_TRUE(s.exporter) << "no export offered";
  const std::string dir = test::temp_dir("gpt-export") + "/gpt2";
  s.exporter(s)(dir);
  nlohmann::json saved, source;
  std::ifstream(dir + "/config.json") >> saved;
  std::ifstream(kFixtures + "/gpt2/config.json") >> source;
  for (const char* key : {"model_type", "n_layer", "n_embd", "n_head", "vocab_size", "n_positions", "activation_function",
                          "layer_norm_epsilon", "tie_word_embeddings", "bos_token_id", "eos_token_id"})
    if (source.contains(key)) EXPECT_EQ(saved[key], source[key]) << key;
  nlohmann::json index;
  std::ifstream(dir + "/model.safetensors.index.json") >> index;
  EXPECT_TRUE(index["weight_map"].contains("transformer.h.1.attn.c_attn.weight"));
  EXPECT_FALSE(index["weight_map"].contains("lm_head.weight"));  // tied, as save_pretrained leaves it out
  EXPECT_EQ(index["weight_map"].size(), s.tensors().size());

  auto back = test::load_graph_text("flowrun: 1\nrun: { steps: 1, device: cpu }\nnodes:\n  model: { type: gpt, with: { pretrained: '" +
                                    dir + "' } }\n");
  ModelState& b = back->state<ModelState>("model", "params");
  for (const auto& [name, t] : s.tensors()) EXPECT_TRUE(torch::equal(b.tensors().at(name), t)) << name;
}

}  // namespace
}  // namespace flowrun
