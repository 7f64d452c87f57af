// tokenize: WordPiece batches ([CLS]/[SEP], truncation and padding; the tokenizer itself:
// tests/formats/wordpiece_test.cpp); SentencePiece (T5 convention) on a model trained
// in the test through the dlmopen'ed shim, in this process that also holds libtorch's libprotobuf,
// and its error without the shim; the node in a graph, with both kinds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <random>

#include "encode/sentencepiece.hpp"
#include "encode/tokenize.hpp"
#include "formats/wordpiece.hpp"
#include "formats/wordpiece_test_vocab.hpp"
#include "node_test_helpers.hpp"

namespace flowrun {
namespace {

using test::kVocab;
using test::make_wp;
using test::Strings;
using test::write_vocab;

TEST(TokenizeWordPiece, EncodeAddsSpecialsTruncatesAndPads) {
  auto wp = make_wp(6);
  TensorMap t = encode_texts(wp, {"The cat sat on the mat", "a cat", ""});
  ASSERT_EQ(t.size(), 2u);
  const torch::Tensor ids = t.at("input_ids"), mask = t.at("attention_mask");
  EXPECT_EQ(ids.scalar_type(), torch::kInt64);
  EXPECT_EQ(mask.scalar_type(), torch::kInt64);
  EXPECT_TRUE(torch::equal(ids, torch::tensor({2, 5, 15, 17, 18, 3, 2, 13, 15, 3, 0, 0, 2, 3, 0, 0, 0, 0},
                                              torch::kInt64).view({3, 6})));
  EXPECT_TRUE(torch::equal(mask, torch::tensor({1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0},
                                               torch::kInt64).view({3, 6})));
}

// SentencePiece runs through the dlmopen'ed flowrun_spm_shim (sentencepiece.hpp): in a build that
// made it (libsentencepiece-dev present) it must load in this process, which links libtorch and
// its libprotobuf (and a copy relocation of std::cerr, which RTLD_DEEPBIND would trip on);
// otherwise the tests check the error and skip.
bool require_sentencepiece() {
  if (sentencepiece_built()) {
    EXPECT_TRUE(sentencepiece_available()) << "flowrun_spm_shim was built but does not load";
    return sentencepiece_available();
  }
  EXPECT_FALSE(sentencepiece_available());
  try {
    SentencePieceTokenizer::load("x.model");
    ADD_FAILURE() << "load without the shim did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("libsentencepiece-dev"), std::string::npos) << e.what();
  }
  return false;
}

// A small unigram model (40 pieces, T5's ids: pad 0, eos 1, unk 2) trained once on generated
// sentences through the shim's trainer.
const std::string& tiny_spm_model() {
  static const std::string model = [] {
    const std::string dir = test::temp_dir("spm");
    const Strings words = {"a", "red", "cat", "sits", "on", "the", "blue", "mat", "dog", "runs", "in", "green",
                           "field", "small", "bird", "flies", "over", "big", "house", "under", "sky"};
    {
      std::ofstream out(dir + "/text.txt");
      std::mt19937 rng(1);
      for (int i = 0; i < 400; ++i) {
        for (int j = 0; j < 8; ++j) out << (j ? " " : "") << words[rng() % words.size()];
        out << "\n";
      }
    }
    SentencePieceTokenizer::train(dir + "/text.txt", dir + "/sp", 40);
    return dir + "/sp.model";
  }();
  return model;
}

TEST(TokenizeSentencePiece, T5ConventionEosPadTruncate) {
  if (!require_sentencepiece()) GTEST_SKIP() << "built without libsentencepiece-dev";
  auto sp = SentencePieceTokenizer::load(tiny_spm_model(), 8);
  EXPECT_EQ(sp->name(), "sentencepiece");
  EXPECT_EQ(sp->pad_id(), 0);
  EXPECT_EQ(sp->eos_id(), 1);
  EXPECT_EQ(sp->vocab_size(), 40);

  const std::vector<int64_t> pieces = sp->piece_ids("a red cat sits");
  ASSERT_FALSE(pieces.empty());
  for (int64_t id : pieces) {
    EXPECT_GT(id, 2);  // no pad/eos/unk inside known text
    EXPECT_LT(id, 40);
  }
  EXPECT_EQ(sp->decode(pieces), "a red cat sits");
  std::vector<int64_t> want = pieces;
  want.push_back(1);
  EXPECT_EQ(sp->ids("a red cat sits", 64), want);
  EXPECT_EQ(sp->ids("", 64), std::vector<int64_t>{1});  // nothing but </s>
  // A character never seen in training is unk (id 2), as in T5's models.
  const std::vector<int64_t> snow = sp->piece_ids("cat \u2603");
  EXPECT_NE(std::find(snow.begin(), snow.end(), 2), snow.end());

  TensorMap t = encode_texts(*sp, {"a red cat sits on the blue mat under the big sky", "dog"});
  const torch::Tensor ids = t.at("input_ids"), mask = t.at("attention_mask");
  ASSERT_EQ(ids.sizes().vec(), (std::vector<int64_t>{2, 8}));
  // Row 0 is longer than 8: 7 pieces, then </s>.
  const std::vector<int64_t> long_pieces = sp->piece_ids("a red cat sits on the blue mat under the big sky");
  ASSERT_GT(long_pieces.size(), 7u);
  for (int64_t i = 0; i < 7; ++i) EXPECT_EQ(ids[0][i].item<int64_t>(), long_pieces[static_cast<size_t>(i)]);
  EXPECT_EQ(ids[0][7].item<int64_t>(), 1);
  EXPECT_EQ(mask[0].sum().item<int64_t>(), 8);
  // Row 1: its pieces, </s>, then pad 0 with mask 0.
  const std::vector<int64_t> dog = sp->piece_ids("dog");
  const int64_t n = static_cast<int64_t>(dog.size()) + 1;
  for (int64_t i = 0; i < n - 1; ++i) EXPECT_EQ(ids[1][i].item<int64_t>(), dog[static_cast<size_t>(i)]);
  EXPECT_EQ(ids[1][n - 1].item<int64_t>(), 1);
  EXPECT_EQ(mask[1].sum().item<int64_t>(), n);
  for (int64_t i = n; i < 8; ++i) {
    EXPECT_EQ(ids[1][i].item<int64_t>(), 0);
    EXPECT_EQ(mask[1][i].item<int64_t>(), 0);
  }

  // lowercase lowercases before encoding.
  auto lower = SentencePieceTokenizer::load(tiny_spm_model(), 8, /*lowercase=*/true);
  EXPECT_EQ(lower->piece_ids("A RED Cat"), sp->piece_ids("a red cat"));
  // Errors name the file.
  try {
    SentencePieceTokenizer::load(test::temp_dir("spm") + "/missing.model");
    ADD_FAILURE() << "no throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("missing.model"), std::string::npos) << e.what();
  }
  EXPECT_THROW(SentencePieceTokenizer::load(tiny_spm_model(), 0), std::runtime_error);
}

// Without the shim (here: FLOWRUN_SPM_SHIM naming no file, in a fresh process since the shim is
// opened once per process) load() says how to fix it.
TEST(TokenizeSentencePiece, MissingShimIsAClearError) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("FLOWRUN_SPM_SHIM", "/nonexistent/libflowrun_spm_shim.so", 1);
        try {
          SentencePieceTokenizer::load("x.model");
        } catch (const std::runtime_error& e) {
          std::fprintf(stderr, "%s\n", e.what());
          std::fflush(stderr);
          std::_Exit(sentencepiece_available() ? 2 : 0);
        }
        std::_Exit(1);
      },
      ::testing::ExitedWithCode(0), "/nonexistent/libflowrun_spm_shim.so.*install libsentencepiece-dev");
}

TEST(TokenizeNode, TokenizesCaptionsAndSharesItsTokenizer) {
  const std::string vocab = write_vocab(kVocab);
  auto g = test::load_graph_text(R"(
flowrun: 1
run: { steps: 2, seed: 1 }
nodes:
  caps: { type: t_captions, with: { captions: ["a cat", "the cat sat on the mat step {step}"] } }
  tok: { type: wordpiece_tokenize, in: { text: caps.text }, with: { vocab: )" + vocab + R"(, max_length: 6 } }
  probe: { type: t_batch_probe, in: { batch: tok.tokens } }
)");
  {
    std::lock_guard<std::mutex> l(test::BatchProbe::mu());
    test::BatchProbe::seen().clear();
  }
  g->run();
  std::lock_guard<std::mutex> l(test::BatchProbe::mu());
  ASSERT_EQ(test::BatchProbe::seen().size(), 2u);
  const TensorMap& b = test::BatchProbe::seen().at(2);
  EXPECT_TRUE(torch::equal(b.at("input_ids"),
                           torch::tensor({2, 13, 15, 3, 0, 0, 2, 5, 15, 17, 18, 3}, torch::kInt64).view({2, 6})));
  EXPECT_TRUE(torch::equal(b.at("attention_mask"),
                           torch::tensor({1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1}, torch::kInt64).view({2, 6})));
  TextTokenizer& tok = g->state<TextTokenizer>("tok", "tokenizer");
  EXPECT_TRUE(torch::equal(encode_texts(tok, {"a cat"}).at("input_ids"), b.at("input_ids").narrow(0, 0, 1)));
}

TEST(TokenizeNode, SentencePieceKindInAGraph) {
  if (!require_sentencepiece()) GTEST_SKIP() << "built without libsentencepiece-dev";
  auto g = test::load_graph_text(R"(
flowrun: 1
run: { steps: 2, seed: 1 }
nodes:
  caps: { type: t_captions, with: { captions: ["a cat", "the cat sat on the mat step {step}"] } }
  tok: { type: sentencepiece_tokenize, in: { text: caps.text }, with: { vocab: )" + tiny_spm_model() +
                                 R"(, max_length: 6 } }
  probe: { type: t_batch_probe, in: { batch: tok.tokens } }
)");
  {
    std::lock_guard<std::mutex> l(test::BatchProbe::mu());
    test::BatchProbe::seen().clear();
  }
  g->run();
  TextTokenizer& tok = g->state<TextTokenizer>("tok", "tokenizer");
  EXPECT_EQ(tok.name(), "sentencepiece");
  EXPECT_EQ(tok.pad_id(), 0);
  auto sp = SentencePieceTokenizer::load(tiny_spm_model(), 6);
  std::lock_guard<std::mutex> l(test::BatchProbe::mu());
  ASSERT_EQ(test::BatchProbe::seen().size(), 2u);
  const TensorMap& b = test::BatchProbe::seen().at(2);
  const TensorMap want = encode_texts(*sp, {"a cat", "the cat sat on the mat step 2"});
  EXPECT_TRUE(torch::equal(b.at("input_ids"), want.at("input_ids"))) << b.at("input_ids");
  EXPECT_TRUE(torch::equal(b.at("attention_mask"), want.at("attention_mask")));
  // Each row: its pieces, cut to 5, then </s>, then pad 0.
  const Strings caps = {"a cat", "the cat sat on the mat step 2"};
  for (int64_t r = 0; r < 2; ++r) {
    std::vector<int64_t> row = sp->piece_ids(caps[static_cast<size_t>(r)]);
    if (row.size() > 5) row.resize(5);
    row.push_back(1);
    const int64_t n = static_cast<int64_t>(row.size());
    row.resize(6, 0);
    EXPECT_TRUE(torch::equal(b.at("input_ids")[r], torch::tensor(row, torch::kInt64))) << r << ": " << b.at("input_ids")[r];
    EXPECT_EQ(b.at("attention_mask")[r].sum().item<int64_t>(), n);
  }
  EXPECT_EQ(b.at("input_ids")[1][5].item<int64_t>(), 1);  // the long caption is truncated
}

TEST(TokenizeNode, UnknownVocabFileIsASetupError) {
  EXPECT_ANY_THROW(test::load_graph_text(R"(
flowrun: 1
run: { steps: 1 }
nodes:
  caps: { type: t_captions, with: { captions: ["a cat", "the cat sat on the mat step {step}"] } }
  tok: { type: wordpiece_tokenize, in: { text: caps.text }, with: { vocab: /nonexistent/vocab.txt } }
)"));
}

}  // namespace
}  // namespace flowrun
