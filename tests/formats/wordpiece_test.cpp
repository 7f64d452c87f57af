// WordPiece as Hugging Face's BertTokenizer, hand-checked on a small vocab: cleaning,
// lowercasing and accents, punctuation, CJK, ## continuations, [UNK], the 100-char limit,
// special tokens, vocab.txt loading and its errors.
#include <gtest/gtest.h>

#include "formats/wordpiece.hpp"
#include "formats/wordpiece_test_vocab.hpp"

namespace flowrun {
namespace {

using test::kVocab;
using test::make_wp;
using test::Strings;
using test::write_vocab;

TEST(TokenizeWordPiece, SplitsOnWhitespaceAndPunctuationAndLowercases) {
  auto wp = make_wp();
  EXPECT_EQ(wp.tokenize("Hello, World!"), (Strings{"hello", ",", "world", "!"}));
  EXPECT_EQ(wp.tokenize("  hello\t\nworld  "), (Strings{"hello", "world"}));
  EXPECT_EQ(wp.tokenize("wait\u2014what."), (Strings{"wait", "\u2014", "what", "."}));  // em dash is Pd
  EXPECT_EQ(wp.tokenize(""), Strings{});
}

TEST(TokenizeWordPiece, StripsAccentsAndControlCharacters) {
  auto wp = make_wp();
  EXPECT_EQ(wp.tokenize("Caf\u00e9 CAF\u00c9"), (Strings{"cafe", "cafe"}));
  EXPECT_EQ(wp.basic_tokenize("a\tcat\n\x01sat"), (Strings{"a", "cat", "sat"}));  // \x01 dropped
  EXPECT_EQ(wp.basic_tokenize("a\xe2\x80\x8b" "cat"), (Strings{"acat"}));  // U+200B (Cf) dropped
}

TEST(TokenizeWordPiece, GreedyLongestMatchWithContinuations) {
  auto wp = make_wp();
  EXPECT_EQ(wp.tokenize("unaffable"), (Strings{"un", "##aff", "##able"}));
  EXPECT_EQ(wp.tokenize("cats"), (Strings{"cat", "##s"}));
  EXPECT_EQ(wp.tokenize("running"), (Strings{"runn", "##ing"}));  // longest first, not "run"
  EXPECT_EQ(wp.tokenize("run"), (Strings{"run"}));
  // A word with one uncoverable part is [UNK] as a whole.
  EXPECT_EQ(wp.tokenize("xcats the"), (Strings{"[UNK]", "the"}));
  EXPECT_EQ(wp.tokenize("catz"), (Strings{"[UNK]"}));
}

// decode: what a captioner generated, as text: specials and padding dropped, "##" glued.
TEST(TokenizeWordPiece, DecodeJoinsPiecesAndDropsSpecialTokens) {
  auto wp = make_wp();
  std::vector<int64_t> ids = wp.ids("Unaffable cats run", 16);
  ids.push_back(wp.pad_id());
  EXPECT_EQ(ids.front(), wp.cls_id());
  EXPECT_EQ(wp.decode(ids), "unaffable cats run");
  EXPECT_EQ(wp.eos_id(), wp.sep_id());
  EXPECT_EQ(wp.decode({wp.token_id("##s"), wp.token_id("cat"), -1, 100000}), "##s cat");  // a leading ## stays
}

TEST(TokenizeWordPiece, WordsOverOneHundredCharactersAreUnk) {
  auto wp = make_wp();
  Strings hundred{"a"};
  for (int i = 1; i < 100; ++i) hundred.push_back("##a");
  EXPECT_EQ(wp.tokenize(std::string(100, 'a')), hundred);
  EXPECT_EQ(wp.tokenize(std::string(101, 'a')), Strings{"[UNK]"});
}

TEST(TokenizeWordPiece, CjkCharactersAreWordsOfTheirOwn) {
  auto wp = make_wp();
  EXPECT_EQ(wp.basic_tokenize("\u732b\u4e2dcat"), (Strings{"\u732b", "\u4e2d", "cat"}));
  EXPECT_EQ(wp.tokenize("\u732b\u4e2dcat"), (Strings{"[UNK]", "\u4e2d", "cat"}));
}

TEST(TokenizeWordPiece, SpecialTokensAndCase) {
  auto wp = make_wp();
  EXPECT_EQ(wp.ids("the [SEP] cat", 16), (std::vector<int64_t>{2, 5, 3, 15, 3}));
  auto cased = make_wp(16, /*lowercase=*/false);
  EXPECT_EQ(cased.basic_tokenize("Caf\u00e9 cat"), (Strings{"Caf\u00e9", "cat"}));
  EXPECT_EQ(cased.tokenize("Hello cat"), (Strings{"[UNK]", "cat"}));
}

TEST(TokenizeWordPiece, LoadsVocabTxtAndNamesTheFileInErrors) {
  const std::string file = write_vocab(kVocab);
  auto wp = WordPieceTokenizer::load(file, 8);
  EXPECT_EQ(wp->vocab_size(), static_cast<int64_t>(kVocab.size()));
  EXPECT_EQ(wp->token_id("##aff"), 7);
  EXPECT_EQ(wp->ids("unaffable!", 8), (std::vector<int64_t>{2, 6, 7, 8, 12, 3}));

  const std::string bad = write_vocab({"[PAD]", "[UNK]", "the"});
  try {
    WordPieceTokenizer::load(bad);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(bad), std::string::npos) << msg;
    EXPECT_NE(msg.find("[CLS]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[SEP]"), std::string::npos) << msg;
  }
  EXPECT_THROW(WordPieceTokenizer::load(bad + ".nope"), std::runtime_error);
}

}  // namespace
}  // namespace flowrun
