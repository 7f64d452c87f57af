// text_encode: BERT and T5 encoders against references composed from plain tensor ops, masking
// (padding never changes the outputs at real tokens), T5's relative position buckets against
// hand-computed values of HF's formula, safetensors load by name (round trip, one error listing
// the problems and naming the file), frozen parameters, and the node in a graph behind tokenize.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <mutex>

#include "common/safetensors.hpp"
#include "common/seed.hpp"
#include "encode/text_encode.hpp"
#include "encode/tokenize.hpp"
#include "models/bert.hpp"
#include "models/t5_encoder.hpp"
#include "node_test_helpers.hpp"

namespace flowrun {
namespace {

using Named = std::map<std::string, torch::Tensor>;

bert::Config bert_config() {
  bert::Config c;
  c.vocab = 30;
  c.dim = 16;
  c.layers = 2;
  c.heads = 2;
  c.ffn = 32;
  c.max_positions = 16;
  return c;
}

t5::Config t5_config(bool gated = true) {
  t5::Config c;
  c.vocab = 30;
  c.dim = 16;
  c.d_kv = 4;
  c.heads = 3;  // heads * d_kv = 12 != dim
  c.ffn = 24;
  c.layers = 2;
  c.buckets = 8;
  c.max_distance = 16;
  c.gated = gated;
  return c;
}

// Every parameter random (norm gains around 1), so that biases and gains matter.
void randomize_encoder(torch::nn::Module& m, uint64_t seed) {
  torch::NoGradGuard no_grad;
  at::Generator g = make_cpu_generator(seed);
  for (auto& item : m.named_parameters(true)) {
    torch::Tensor r = torch::randn(item.value().sizes(), g);
    const std::string& n = item.key();
    const bool norm = n.find("LayerNorm.weight") != std::string::npos || n.find("layer_norm.weight") != std::string::npos;
    item.value().copy_(norm ? 1.0 + 0.2 * r : 0.5 * r);
  }
}


torch::Tensor ids_tensor(std::vector<int64_t> v, int64_t B, int64_t L) {
  return torch::tensor(v, torch::kInt64).view({B, L});
}

// ---- references: plain ops on the named tensors ----

torch::Tensor lin(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b = {}) {
  torch::Tensor y = torch::matmul(x, w.t());
  return b.defined() ? y + b : y;
}

torch::Tensor layer_norm_ref(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, double eps) {
  torch::Tensor mu = x.mean(-1, true), var = (x - mu).pow(2).mean(-1, true);
  return (x - mu) / torch::sqrt(var + eps) * w + b;
}

// softmax(scores) with masked keys excluded: weights exactly 0 there.
torch::Tensor masked_softmax(torch::Tensor scores, const torch::Tensor& mask) {
  const int64_t B = mask.size(0), L = mask.size(1);
  scores = scores.masked_fill((mask == 0).view({B, 1, 1, L}), -std::numeric_limits<float>::infinity());
  return torch::softmax(scores, -1);
}

torch::Tensor bert_reference(Named& P, const bert::Config& c, const torch::Tensor& ids, const torch::Tensor& mask) {
  const int64_t B = ids.size(0), L = ids.size(1), H = c.heads, dh = c.dim / c.heads;
  torch::Tensor x = P["embeddings.word_embeddings.weight"].index_select(0, ids.flatten()).view({B, L, c.dim}) +
                    P["embeddings.position_embeddings.weight"].narrow(0, 0, L) +
                    P["embeddings.token_type_embeddings.weight"][0];
  x = layer_norm_ref(x, P["embeddings.LayerNorm.weight"], P["embeddings.LayerNorm.bias"], 1e-12);
  for (int64_t l = 0; l < c.layers; ++l) {
    const std::string p = "encoder.layer." + std::to_string(l) + ".";
    auto proj = [&](const std::string& n) {
      return lin(x, P[p + "attention.self." + n + ".weight"], P[p + "attention.self." + n + ".bias"])
          .view({B, L, H, dh})
          .permute({0, 2, 1, 3});
    };
    torch::Tensor q = proj("query"), k = proj("key"), v = proj("value");
    torch::Tensor w = masked_softmax(torch::matmul(q, k.transpose(2, 3)) / std::sqrt(double(dh)), mask);
    torch::Tensor ctx = torch::matmul(w, v).permute({0, 2, 1, 3}).reshape({B, L, c.dim});
    torch::Tensor a = layer_norm_ref(
        lin(ctx, P[p + "attention.output.dense.weight"], P[p + "attention.output.dense.bias"]) + x,
        P[p + "attention.output.LayerNorm.weight"], P[p + "attention.output.LayerNorm.bias"], 1e-12);
    torch::Tensor h = lin(a, P[p + "intermediate.dense.weight"], P[p + "intermediate.dense.bias"]);
    h = 0.5 * h * (1 + torch::erf(h / std::sqrt(2.0)));
    x = layer_norm_ref(lin(h, P[p + "output.dense.weight"], P[p + "output.dense.bias"]) + a,
                       P[p + "output.LayerNorm.weight"], P[p + "output.LayerNorm.bias"], 1e-12);
  }
  return x;
}

// HF's _relative_position_bucket for one distance, in scalar arithmetic.
int64_t bucket_ref(int64_t rel, bool bidirectional, int64_t nb, int64_t max_distance) {
  int64_t ret = 0;
  if (bidirectional) {
    nb /= 2;
    if (rel > 0) ret += nb;
    rel = std::abs(rel);
  } else {
    rel = -std::min<int64_t>(rel, 0);
  }
  const int64_t max_exact = nb / 2;
  if (rel < max_exact) return ret + rel;
  const float f = std::log(static_cast<float>(rel) / max_exact) / static_cast<float>(std::log(double(max_distance) / max_exact)) *
                  static_cast<float>(nb - max_exact);
  return ret + std::min<int64_t>(max_exact + static_cast<int64_t>(f), nb - 1);
}

torch::Tensor rms_ref(const torch::Tensor& x, const torch::Tensor& w) {
  return w * (x / torch::sqrt(x.pow(2).mean(-1, true) + 1e-6));
}

torch::Tensor t5_reference(Named& P, const t5::Config& c, const torch::Tensor& ids, const torch::Tensor& mask) {
  const int64_t B = ids.size(0), L = ids.size(1), H = c.heads;
  torch::Tensor x = P["shared.weight"].index_select(0, ids.flatten()).view({B, L, c.dim});
  // position bias [1, H, L, L]: bias[h][i][j] = table[bucket(j - i)][h]
  torch::Tensor table = P["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"];
  torch::Tensor pos = torch::zeros({1, H, L, L});
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < L; ++j)
      pos.select(0, 0).select(1, i).select(1, j).copy_(table[bucket_ref(j - i, true, c.buckets, c.max_distance)]);
  for (int64_t l = 0; l < c.layers; ++l) {
    const std::string p = "encoder.block." + std::to_string(l) + ".layer.";
    torch::Tensor h = rms_ref(x, P[p + "0.layer_norm.weight"]);
    auto proj = [&](const std::string& n) {
      return lin(h, P[p + "0.SelfAttention." + n + ".weight"]).view({B, L, H, c.d_kv}).permute({0, 2, 1, 3});
    };
    torch::Tensor q = proj("q"), k = proj("k"), v = proj("v");
    torch::Tensor w = masked_softmax(torch::matmul(q, k.transpose(2, 3)) + pos, mask);
    x = x + lin(torch::matmul(w, v).permute({0, 2, 1, 3}).reshape({B, L, H * c.d_kv}), P[p + "0.SelfAttention.o.weight"]);
    h = rms_ref(x, P[p + "1.layer_norm.weight"]);
    torch::Tensor f;
    if (c.gated) {
      torch::Tensor g = lin(h, P[p + "1.DenseReluDense.wi_0.weight"]);
      g = 0.5 * g * (1 + torch::tanh(std::sqrt(2.0 / std::acos(-1.0)) * (g + 0.044715 * g.pow(3))));
      f = g * lin(h, P[p + "1.DenseReluDense.wi_1.weight"]);
    } else {
      f = torch::relu(lin(h, P[p + "1.DenseReluDense.wi.weight"]));
    }
    x = x + lin(f, P[p + "1.DenseReluDense.wo.weight"]);
  }
  return rms_ref(x, P["encoder.final_layer_norm.weight"]);
}

const torch::Tensor kIds = ids_tensor({2, 7, 9, 11, 3, 0, 0, 0, 2, 5, 6, 13, 29, 17, 4, 3}, 2, 8);
const torch::Tensor kMask = ids_tensor({1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1}, 2, 8);

// ---- BERT ----

TEST(TextEncodeBert, MatchesAReferenceComposedFromPlainOps) {
  const bert::Config c = bert_config();
  bert::Bert m(c);
  randomize_encoder(*m, 1);
  Named P = test::snapshot(*m);
  torch::NoGradGuard no_grad;
  torch::Tensor got = m->forward(kIds, kMask), want = bert_reference(P, c, kIds, kMask);
  ASSERT_EQ(got.sizes().vec(), (std::vector<int64_t>{2, 8, 16}));
  EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-5)) << (got - want).abs().max();
}

TEST(TextEncodeBert, ParameterNamesAreHuggingFaces) {
  bert::Bert m(bert_config());
  std::vector<std::string> names;
  for (const auto& item : m->named_parameters(true)) names.push_back(item.key());
  const std::vector<std::string> head = {"embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
                                         "embeddings.token_type_embeddings.weight", "embeddings.LayerNorm.weight",
                                         "embeddings.LayerNorm.bias", "encoder.layer.0.attention.self.query.weight",
                                         "encoder.layer.0.attention.self.query.bias"};
  ASSERT_GE(names.size(), head.size());
  for (size_t i = 0; i < head.size(); ++i) EXPECT_EQ(names[i], head[i]);
  EXPECT_EQ(names.size(), 5u + 2u * 16u);
  auto has = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) != names.end(); };
  for (const char* n : {"encoder.layer.1.attention.output.dense.weight", "encoder.layer.1.attention.output.LayerNorm.bias",
                        "encoder.layer.1.intermediate.dense.bias", "encoder.layer.1.output.dense.weight",
                        "encoder.layer.1.output.LayerNorm.weight", "encoder.layer.1.attention.self.value.bias"})
    EXPECT_TRUE(has(n)) << n;
}

template <class Model>
void expect_padding_does_not_matter(Model& m) {
  torch::NoGradGuard no_grad;
  torch::Tensor padded = m->forward(kIds, kMask);
  // Row 0 alone, without its padding.
  torch::Tensor alone = m->forward(kIds.narrow(0, 0, 1).narrow(1, 0, 5), torch::ones({1, 5}, torch::kInt64));
  EXPECT_TRUE(torch::allclose(padded.narrow(0, 0, 1).narrow(1, 0, 5), alone, 1e-5, 1e-5));
  // Other ids under the mask change nothing at the real tokens.
  torch::Tensor other = kIds.clone();
  other[0].narrow(0, 5, 3).fill_(21);  // row 0's padding only
  torch::Tensor again = m->forward(other, kMask);
  EXPECT_TRUE(torch::allclose(again.narrow(0, 0, 1).narrow(1, 0, 5), padded.narrow(0, 0, 1).narrow(1, 0, 5), 1e-5, 1e-5));
  EXPECT_TRUE(torch::allclose(again[1], padded[1], 1e-6, 1e-6));
}

TEST(TextEncodeBert, PaddingDoesNotChangeRealTokens) {
  bert::Bert m(bert_config());
  randomize_encoder(*m, 2);
  expect_padding_does_not_matter(m);
}

TEST(TextEncodeBert, SafetensorsRoundTripByNameWithBertPrefix) {
  const bert::Config c = bert_config();
  bert::Bert a(c), b(c);
  randomize_encoder(*a, 3);
  bert::init_weights(*b, 4);
  safetensors::Tensors t;
  for (const auto& [k, v] : test::snapshot(*a)) t["bert." + k] = v;
  t["bert.pooler.dense.weight"] = torch::zeros({16, 16});        // ignored
  t["bert.embeddings.position_ids"] = torch::arange(16).view({1, 16});  // ignored buffer
  const std::string file = test::temp_dir("text_encode") + "/bert.safetensors";
  safetensors::save(file, t);
  bert::load_hf_safetensors(*b, file);
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(a->forward(kIds, kMask), b->forward(kIds, kMask)));
}

TEST(TextEncodeBert, LoadingListsMissingAndMisshapedTensorsAndNamesTheFile) {
  const bert::Config c = bert_config();
  bert::Bert a(c);
  safetensors::Tensors t = test::snapshot(*a);
  t.erase("encoder.layer.1.attention.output.LayerNorm.bias");
  t["encoder.layer.0.intermediate.dense.weight"] = torch::zeros({8, 16});
  t["encoder.layer.0.attention.self.qkv.weight"] = torch::zeros({2});
  const std::string file = test::temp_dir("text_encode") + "/bad_bert.safetensors";
  safetensors::save(file, t);
  bert::Bert b(c);
  try {
    bert::load_hf_safetensors(*b, file);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(file), std::string::npos) << msg;
    EXPECT_NE(msg.find("missing: encoder.layer.1.attention.output.LayerNorm.bias"), std::string::npos) << msg;
    EXPECT_NE(msg.find("mis-shaped: encoder.layer.0.intermediate.dense.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("unexpected: encoder.layer.0.attention.self.qkv.weight"), std::string::npos) << msg;
  }
}

// ---- T5 ----

TEST(TextEncodeT5, RelativePositionBucketsMatchHuggingFacesFormula) {
  // Hand-computed from HF's _relative_position_bucket (num_buckets 32, max_distance 128).
  // Bidirectional: 16 buckets per direction, exact up to 7, then 8 + floor(log(d/8)/log(16)*8).
  const std::vector<std::pair<int64_t, int64_t>> bi = {{0, 0},   {-1, 1},    {1, 17},   {-7, 7},  {7, 23},
                                                       {8, 24},  {-20, 10},  {20, 26},  {100, 31}, {-127, 15},
                                                       {-200, 15}, {1000, 31}};
  // Unidirectional (decoder): only the past counts, 32 buckets, exact up to 15.
  const std::vector<std::pair<int64_t, int64_t>> uni = {{5, 0}, {-5, 5}, {-20, 17}, {-1000, 31}};
  auto run = [](const std::vector<std::pair<int64_t, int64_t>>& cases, bool bidirectional) {
    std::vector<int64_t> rel;
    for (auto [r, _] : cases) rel.push_back(r);
    torch::Tensor got = t5::relative_position_bucket(torch::tensor(rel, torch::kInt64), bidirectional, 32, 128);
    for (size_t i = 0; i < cases.size(); ++i)
      EXPECT_EQ(got[static_cast<int64_t>(i)].item<int64_t>(), cases[i].second)
          << "relative position " << cases[i].first << (bidirectional ? " (bidirectional)" : " (causal)");
  };
  run(bi, true);
  run(uni, false);
  for (int64_t r = -40; r <= 40; ++r)  // and the scalar reference the forward test uses
    EXPECT_EQ(t5::relative_position_bucket(torch::tensor({r}), true, 8, 16)[0].item<int64_t>(),
              bucket_ref(r, true, 8, 16)) << r;
}

TEST(TextEncodeT5, MatchesAReferenceComposedFromPlainOps) {
  for (bool gated : {true, false}) {
    const t5::Config c = t5_config(gated);
    t5::T5Encoder m(c);
    randomize_encoder(*m, 5);
    Named P = test::snapshot(*m);
    torch::NoGradGuard no_grad;
    torch::Tensor got = m->forward(kIds, kMask), want = t5_reference(P, c, kIds, kMask);
    ASSERT_EQ(got.sizes().vec(), (std::vector<int64_t>{2, 8, 16}));
    EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-5)) << (gated ? "gated " : "relu ") << (got - want).abs().max();
  }
}

TEST(TextEncodeT5, ParameterNamesAreHuggingFaces) {
  t5::T5Encoder m(t5_config());
  std::vector<std::string> names;
  for (const auto& item : m->named_parameters(true)) names.push_back(item.key());
  const std::vector<std::string> want = {
      "shared.weight",
      "encoder.block.0.layer.0.SelfAttention.q.weight",
      "encoder.block.0.layer.0.SelfAttention.k.weight",
      "encoder.block.0.layer.0.SelfAttention.v.weight",
      "encoder.block.0.layer.0.SelfAttention.o.weight",
      "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
      "encoder.block.0.layer.0.layer_norm.weight",
      "encoder.block.0.layer.1.DenseReluDense.wi_0.weight",
      "encoder.block.0.layer.1.DenseReluDense.wi_1.weight",
      "encoder.block.0.layer.1.DenseReluDense.wo.weight",
      "encoder.block.0.layer.1.layer_norm.weight",
      "encoder.block.1.layer.0.SelfAttention.q.weight",
      "encoder.block.1.layer.0.SelfAttention.k.weight",
      "encoder.block.1.layer.0.SelfAttention.v.weight",
      "encoder.block.1.layer.0.SelfAttention.o.weight",
      "encoder.block.1.layer.0.layer_norm.weight",
      "encoder.block.1.layer.1.DenseReluDense.wi_0.weight",
      "encoder.block.1.layer.1.DenseReluDense.wi_1.weight",
      "encoder.block.1.layer.1.DenseReluDense.wo.weight",
      "encoder.block.1.layer.1.layer_norm.weight",
      "encoder.final_layer_norm.weight"};
  EXPECT_EQ(names, want);
  EXPECT_EQ(m->named_parameters()["encoder.block.0.layer.0.SelfAttention.q.weight"].sizes().vec(),
            (std::vector<int64_t>{12, 16}));
}

TEST(TextEncodeT5, PaddingDoesNotChangeRealTokens) {
  t5::T5Encoder m(t5_config());
  randomize_encoder(*m, 6);
  expect_padding_does_not_matter(m);
}

TEST(TextEncodeT5, SafetensorsRoundTripWithTiedEmbedTokens) {
  const t5::Config c = t5_config();
  t5::T5Encoder a(c), b(c);
  randomize_encoder(*a, 7);
  t5::init_weights(*b, 8);
  safetensors::Tensors t = test::snapshot(*a);
  t["encoder.embed_tokens.weight"] = t.at("shared.weight");  // as HF saves T5EncoderModel
  const std::string file = test::temp_dir("text_encode") + "/t5.safetensors";
  safetensors::save(file, t);
  t5::load_hf_safetensors(*b, file);
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(a->forward(kIds, kMask), b->forward(kIds, kMask)));

  // A file of the other feed-forward kind: names the missing and unexpected tensors.
  t5::T5Encoder relu(t5_config(false));
  try {
    t5::load_hf_safetensors(*relu, file);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(file), std::string::npos) << msg;
    EXPECT_NE(msg.find("missing: encoder.block.0.layer.1.DenseReluDense.wi.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("unexpected: encoder.block.1.layer.1.DenseReluDense.wi_1.weight"), std::string::npos) << msg;
  }
}

TEST(TextEncodeT5, MissingRelativeAttentionBiasIsNamed) {
  t5::T5Encoder a(t5_config());
  safetensors::Tensors t = test::snapshot(*a);
  t.erase("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight");
  const std::string file = test::temp_dir("text_encode") + "/t5_missing.safetensors";
  safetensors::save(file, t);
  t5::T5Encoder b(t5_config());
  try {
    t5::load_hf_safetensors(*b, file);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(file), std::string::npos) << msg;
    EXPECT_NE(msg.find("missing: encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
              std::string::npos)
        << msg;
  }
}

// ---- the state and the node ----

TEST(TextEncodeState, FrozenAndEncodeTextUsesThePrefix) {
  t5::T5Encoder m(t5_config());
  randomize_encoder(*m, 9);
  auto s = make_text_encoder_state(m.ptr(), "t5", "t5");
  EXPECT_TRUE(s->trainable_parameters().empty());
  for (const auto& [n, p] : s->named_parameters()) EXPECT_FALSE(p.requires_grad()) << n;
  EXPECT_FALSE(m->is_training());
  TensorMap out = encode_text(*s, {{"input_ids", kIds}, {"attention_mask", kMask}});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out.at("t5_emb").scalar_type(), torch::kFloat);
  EXPECT_FALSE(out.at("t5_emb").requires_grad());
  EXPECT_TRUE(torch::equal(out.at("t5_mask"), kMask));
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(out.at("t5_emb"), m->forward(kIds, kMask)));
  auto copy = s->clone();
  EXPECT_TRUE(std::dynamic_pointer_cast<TextEncoderState>(copy));
  EXPECT_TRUE(copy->trainable_parameters().empty());
  EXPECT_TRUE(torch::equal(encode_text(*copy, {{"input_ids", kIds}}).at("t5_emb"), m->forward(kIds)));
}

TEST(TextEncodeNode, TokenizeThenTwoFrozenEncoders) {
  const std::string vocab = test::temp_dir("text_encode") + "/vocab.txt";
  {
    std::ofstream out(vocab);
    for (const char* t : {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "a", "cat", "sat", "on", "the", "mat"}) out << t << "\n";
  }
  auto g = test::load_graph_text(R"(
flowrun: 1
run: { steps: 2, seed: 5 }
nodes:
  caps: { type: t_captions, with: { captions: ["a cat sat", "the cat sat on the mat"] } }
  tok: { type: wordpiece_tokenize, in: { text: caps.text }, with: { vocab: )" + vocab + R"(, max_length: 8 } }
  bert: { type: bert_encode, in: { tokens: tok.tokens },
          with: { vocab: 10, dim: 16, layers: 1, heads: 2, ffn: 32, max_positions: 8 } }
  bert2: { type: bert_encode, in: { tokens: tok.tokens },
           with: { vocab: 10, dim: 16, layers: 1, heads: 2, ffn: 32, max_positions: 8 } }
  t5: { type: t5_encode, in: { tokens: tok.tokens },
        with: { vocab: 10, dim: 16, layers: 1, heads: 2, d_kv: 8, ffn: 24, dtype: bfloat16, out_prefix: t5 } }
  probe: { type: t_batch_probe, in: { batch: bert.emb } }
)");
  {
    std::lock_guard<std::mutex> l(test::BatchProbe::mu());
    test::BatchProbe::seen().clear();
  }
  g->run();
  ModelState& bert = g->state<ModelState>("bert", "params");
  ModelState& bert2 = g->state<ModelState>("bert2", "params");
  ModelState& t5 = g->state<ModelState>("t5", "params");
  for (ModelState* s : {&bert, &t5}) {
    EXPECT_TRUE(s->trainable_parameters().empty());
    for (const auto& [n, p] : s->named_parameters()) EXPECT_FALSE(p.requires_grad()) << n;
  }
  // Seeded from run.seed and the node's name: two nodes differ.
  EXPECT_FALSE(torch::equal(bert.named_parameters()[0].second, bert2.named_parameters()[0].second));
  EXPECT_EQ(t5.named_parameters()[0].second.scalar_type(), torch::kBFloat16);

  std::lock_guard<std::mutex> l(test::BatchProbe::mu());
  ASSERT_EQ(test::BatchProbe::seen().size(), 2u);
  const TensorMap& emb = test::BatchProbe::seen().at(1);
  ASSERT_EQ(emb.size(), 2u);
  EXPECT_EQ(emb.at("text_emb").sizes().vec(), (std::vector<int64_t>{2, 8, 16}));
  EXPECT_EQ(emb.at("text_emb").scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::equal(emb.at("text_mask"),
                           torch::tensor({1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1}, torch::kInt64).view({2, 8})));
  // A sampler's path: the shared tokenizer, then encode_text on the encoder's state.
  TextTokenizer& tok = g->state<TextTokenizer>("tok", "tokenizer");
  TensorMap again = encode_text(bert, encode_texts(tok, {"a cat sat", "the cat sat on the mat"}));
  EXPECT_TRUE(torch::equal(again.at("text_emb"), emb.at("text_emb")));
  TensorMap t5_out = encode_text(t5, encode_texts(tok, {"a cat sat"}));
  EXPECT_EQ(t5_out.count("t5_emb"), 1u);
  EXPECT_EQ(t5_out.at("t5_emb").scalar_type(), torch::kFloat);
  EXPECT_EQ(t5_out.at("t5_emb").sizes().vec(), (std::vector<int64_t>{1, 8, 16}));
}

TEST(TextEncodeNode, BadWeightsFileIsASetupErrorNamingTheNodeAndFile) {
  const std::string dir = test::temp_dir("text_encode");
  const std::string vocab = dir + "/vocab.txt", file = dir + "/partial_bert.safetensors";
  {
    std::ofstream out(vocab);
    for (const char* t : {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "a"}) out << t << "\n";
  }
  safetensors::save(file, {{"embeddings.word_embeddings.weight", torch::zeros({5, 16})}});
  try {
    test::load_graph_text(R"(
flowrun: 1
run: { steps: 1 }
nodes:
  caps: { type: t_captions, with: { captions: ["a cat sat", "the cat sat on the mat"] } }
  tok: { type: wordpiece_tokenize, in: { text: caps.text }, with: { vocab: )" + vocab + R"( } }
  enc: { type: bert_encode, in: { tokens: tok.tokens },
         with: { vocab: 5, dim: 16, layers: 1, heads: 2, ffn: 32, weights: )" + file + R"( } }
)");
    FAIL() << "no error";
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'enc'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(file), std::string::npos) << msg;
    EXPECT_NE(msg.find("missing: embeddings.position_embeddings.weight"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace flowrun
