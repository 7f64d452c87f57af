// Tokenizers: the byte tokenizer round-trips any bytes; GPT-2's BPE gives exactly the ids of
// OpenAI's tiktoken (its gpt2 encoding) on real text and tricky strings. The GPT-2 tests need
// scripts/data.sh to have run (data/gpt2/); without it they are skipped.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include "formats/tokenizer.hpp"
#include "nodes/data_test_helpers.hpp"
#include "support/run_graph.hpp"

namespace flowrun {
namespace {

using Pieces = std::vector<std::string>;

Pieces pretok(const std::string& s) {
  Pieces out;
  for (auto v : gpt2_pretokenize(s)) out.emplace_back(v);
  return out;
}

const BpeTokenizer& gpt2() {
  static std::unique_ptr<BpeTokenizer> t = BpeTokenizer::load_gpt2(test::gpt2_vocab(), test::gpt2_merges());
  return *t;
}

// Strings that exercise every branch of the pre-tokenizer and the BPE.
const std::vector<std::string> kTricky = {
    "Hello world",
    "I'm sure you're right, we've seen they'll say he'd do it, she's done, it't",
    "DON'T SHOUT'S 'S 'd ''s ' s x' '' '''ll",
    "hello   world  with   multiple    spaces",
    "   leading spaces",
    "trailing spaces   ",
    "a  \n\n  b\n\n\nc\n",
    "\n\n\n",
    " ",
    "  ",
    "'",
    "tabs\t\tand\tspaces \t mixed\t",
    "CRLF line\r\nnext\r\n",
    "\x0b\x0c vertical tab and form feed",
    "control \x01\x02\x7f bytes",
    "numbers 1234567890 3.14159 1,000,000 -42 +7 0x1F 2nd 3rd",
    "superscripts and fractions: x\u00b2 y\u00b3 \u00bd \u2153 \u216b roman",
    "unicode letters: h\u00e9llo w\u00f6rld na\u00efve caf\u00e9 fa\u00e7ade \u00df \u01c5 \u02b0",
    "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac \u0420\u0443\u0441\u0441\u043a\u0438\u0439 \u65e5\u672c\u8a9e \u4e2d\u6587 "
    "\ud55c\uad6d\uc5b4 \u05e2\u05d1\u05e8\u05d9\u05ea \u0627\u0644\u0639\u0631\u0628\u064a\u0629 "
    "\u0939\u093f\u0928\u094d\u0926\u0940",
    "digits elsewhere: \u0663\u0664\u0665 \u06f1\u06f2 \u0967\u0968 \uff11\uff12",
    "astral letters \U0001d518\U0001d52b\U0001d526\U0001d520 and emoji \U0001f600\U0001f44d\U0001f3fd "
    "\U0001f1eb\U0001f1f7 \U0001f468\u200d\U0001f469\u200d\U0001f467",
    "combining e\u0301 a\u0308 n\u0303",
    "non-breaking\u00a0space thin\u2009space ideographic\u3000space en\u2002quad",
    "line\u2028separator paragraph\u2029separator",
    "zero\u200bwidth joiner\u200d",
    "punctuation!!! ??? ... --- *** ((x)) [y] {z} <a href=\"#\">",
    "email@example.com https://example.org/path?q=1&r=2#frag",
    "mixed123abc456def 12ab 3.4e-5",
    "  \n  x",
    " \t x",
    "x \u00a0y",
    "x \u0085y next\u0085\u0085line",
    "x \ufeffy \ufeff",
    "end with newline\n",
    "ends with space before newline \n",
    "over\bstrike _\b_ (fortune files have these)",
};

// ---- byte ----------------------------------------------------------------------------------

TEST(ByteTokenizer, EveryByteRoundTrips) {
  ByteTokenizer t;
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  std::vector<int32_t> ids = t.encode(all);
  ASSERT_EQ(ids.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(ids[b], b);
  EXPECT_EQ(t.decode(ids), all);
  EXPECT_EQ(t.vocab_size(), 256);
  EXPECT_FALSE(t.eot().has_value());
  for (const std::string& s : kTricky) EXPECT_EQ(t.decode(t.encode(s)), s);
  EXPECT_THROW(t.decode({256}), std::out_of_range);
}

// ---- pre-tokenizer -------------------------------------------------------------------------

TEST(Gpt2Pretokenize, SplitsLikeGpt2sRegex) {
  EXPECT_EQ(pretok("Hello world"), (Pieces{"Hello", " world"}));
  EXPECT_EQ(pretok("they're here"), (Pieces{"they", "'re", " here"}));
  EXPECT_EQ(pretok("DON'T"), (Pieces{"DON", "'", "T"}));  // contractions are lower case only
  EXPECT_EQ(pretok("x''s"), (Pieces{"x", "''", "s"}));    // an apostrophe run is punctuation
  EXPECT_EQ(pretok("a   b"), (Pieces{"a", "  ", " b"}));  // the last space joins the word
  EXPECT_EQ(pretok("a \n b"), (Pieces{"a", " \n", " b"}));
  EXPECT_EQ(pretok("a\nb"), (Pieces{"a", "\n", "b"}));    // a single space char stands alone
  EXPECT_EQ(pretok("end  "), (Pieces{"end", "  "}));      // trailing run: all of it
  EXPECT_EQ(pretok("x 12ab"), (Pieces{"x", " 12", "ab"}));
  EXPECT_EQ(pretok(" !? x"), (Pieces{" !?", " x"}));
  EXPECT_EQ(pretok("caf\u00e9 \u65e5\u672c"), (Pieces{"caf\u00e9", " \u65e5\u672c"}));
  EXPECT_EQ(pretok("x\u00b2"), (Pieces{"x", "\u00b2"}));  // superscript two is a number (No)
  EXPECT_TRUE(pretok("").empty());
}

TEST(Gpt2Pretokenize, WhitespaceIsTheUnicodeWhiteSpaceProperty) {
  // As GPT-2's encoder.py (Python `regex`) and tiktoken: U+0085 is whitespace, U+FEFF is not
  // (JavaScript's \s, and so the npm package gpt-3-encoder, says the opposite for these two).
  EXPECT_EQ(pretok("x \u0085y"), (Pieces{"x", " ", "\u0085", "y"}));
  EXPECT_EQ(pretok("x \ufeffy"), (Pieces{"x", " \ufeff", "y"}));
  // Only an ASCII space joins the next word (" ?\p{L}+"); other whitespace stands alone.
  EXPECT_EQ(pretok("x\u3000\u3000y"), (Pieces{"x", "\u3000", "\u3000", "y"}));
}

TEST(Gpt2Pretokenize, PiecesCoverAnyBytesExactly) {  // Llama 3's and Qwen's too
  // Invalid UTF-8 included: every byte ends up in exactly one piece, in order.
  static const char kPool[] = "a '\n\xc3\xa9\xe6\x97\xa5\xf0\x9f\x98\x80";  // pieces of valid characters
  std::mt19937 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    std::string s(static_cast<size_t>(rng() % 64), '\0');
    for (char& c : s) c = static_cast<char>(rng() % 2 ? kPool[rng() % (sizeof(kPool) - 1)] : rng() % 256);
    for (const auto& pieces : {gpt2_pretokenize(s), llama3_pretokenize(s, 3), llama3_pretokenize(s, 1)}) {
      std::string joined;
      for (auto v : pieces) {
        EXPECT_FALSE(v.empty());
        joined += v;
      }
      EXPECT_EQ(joined, s);
    }
  }
}

// Llama 3's and Qwen 2/3's Split regex: the pieces of `tokenizers` itself on tricky strings and
// 1,000 fortunes (tests/fixtures/tokenizers/make_pretokenize_fixture.py wrote their UTF-8 byte
// lengths with tokenizers 0.23.3), and a few cases spelled out.
TEST(Llama3Pretokenize, SplitsAsTheTokenizersLibraryDoesForLlama3AndQwen) {
  auto pieces = [](const std::string& s, int digits) {
    Pieces out;
    for (auto v : llama3_pretokenize(s, digits)) out.emplace_back(v);
    return out;
  };
  EXPECT_EQ(pieces("I'M (sure) it's 12345!!!\n\n x", 3),
            (Pieces{"I", "'M", " (", "sure", ")", " it", "'s", " ", "123", "45", "!!!\n\n", " x"}));
  EXPECT_EQ(pieces("12345", 1), (Pieces{"1", "2", "3", "4", "5"}));
  EXPECT_EQ(pieces("a  \n\t b\tc", 3), (Pieces{"a", "  \n", "\t", " b", "\tc"}));

  const std::string path = std::string(FLOWRUN_SOURCE_DIR) + "/tests/fixtures/tokenizers/pretokenize.json";
  std::ifstream in(path);
  ASSERT_TRUE(in) << path;
  const nlohmann::json fixture = nlohmann::json::parse(in);
  int checked = 0;
  for (const auto& [name, digits] : std::vector<std::pair<std::string, int>>{{"llama3", 3}, {"qwen2", 1}}) {
    int wrong = 0;
    for (const auto& c : fixture["cases"]) {
      const std::string text = c["text"].get<std::string>();
      std::vector<size_t> got;
      for (auto v : llama3_pretokenize(text, digits)) got.push_back(v.size());
      const auto want = c[name].get<std::vector<size_t>>();
      if (got != want && wrong++ < 3) ADD_FAILURE() << name << ": pieces differ from tokenizers' for " << nlohmann::json(text).dump();
      ++checked;
    }
    EXPECT_EQ(wrong, 0) << name << ": " << wrong << " of " << fixture["cases"].size() << " texts split otherwise";
  }
  EXPECT_GT(checked, 2000);
}

// ---- GPT-2 BPE -----------------------------------------------------------------------------

TEST(Gpt2Tokenizer, HelloWorld) {
  FLOWRUN_NEEDS_DATA(test::gpt2_vocab(), test::gpt2_merges());
  EXPECT_EQ(gpt2().encode("Hello world"), (std::vector<int32_t>{15496, 995}));
  EXPECT_EQ(gpt2().vocab_size(), 50257);
  EXPECT_EQ(gpt2().eot(), std::optional<int32_t>(50256));
  EXPECT_EQ(gpt2().decode({50256}), "<|endoftext|>");
  EXPECT_EQ(gpt2().token_id(" the"), std::optional<int32_t>(262));
}

TEST(Gpt2Tokenizer, DecodeInvertsEncodeForAnyBytes) {
  FLOWRUN_NEEDS_DATA(test::gpt2_vocab(), test::gpt2_merges());
  for (const std::string& s : kTricky) EXPECT_EQ(gpt2().decode(gpt2().encode(s)), s);
  std::mt19937 rng(5);
  for (int trial = 0; trial < 100; ++trial) {
    std::string s(static_cast<size_t>(rng() % 100), '\0');
    for (char& c : s) c = static_cast<char>(rng() % 256);
    EXPECT_EQ(gpt2().decode(gpt2().encode(s)), s);
  }
  EXPECT_THROW(gpt2().decode({50257}), std::out_of_range);
}

TEST(Gpt2Tokenizer, SameIdsAsTiktoken) {
  FLOWRUN_NEEDS_DATA(test::gpt2_vocab(), test::gpt2_merges());
  // tiktoken comes with the environment scripts/setup.sh makes (requirements.txt).
  const std::string python = FLOWRUN_PYTHON;
  ASSERT_EQ(std::system(("'" + python + "' -c 'import tiktoken' > /dev/null 2>&1").c_str()), 0)
      << python << " cannot import tiktoken: pip install -r requirements.txt (scripts/setup.sh does)";
  const std::vector<std::string> fortunes = test::all_fortunes();
  ASSERT_GT(fortunes.size(), 10000u) << "the fortunes text is missing: install Debian's fortunes package";

  // Every fortune (tiktoken takes a second for all 15k; a few have non-ASCII text) and the
  // tricky strings (many scripts, U+0085 and U+FEFF among them).
  std::vector<std::string> texts = fortunes;
  const size_t n_fortunes = texts.size();
  size_t non_ascii = 0;
  for (const std::string& s : texts) non_ascii += std::any_of(s.begin(), s.end(), [](char c) { return c & 0x80; });
  for (const std::string& s : kTricky) texts.push_back(s);

  const std::string dir = test::temp_dir("gpt2ref");
  std::ofstream(dir + "/in.json") << nlohmann::json(texts).dump();
  const std::string cmd = "'" + python + "' '" + std::string(FLOWRUN_SOURCE_DIR) + "/tests/support/gpt2_reference.py' '" +
                          test::gpt2_vocab() + "' '" + test::gpt2_merges() + "' '" + dir + "/in.json' '" + dir + "/out.json'";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const auto want = nlohmann::json::parse(test::read_text(dir + "/out.json"));
  ASSERT_EQ(want.size(), texts.size());
  size_t mismatches = 0, tokens = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::vector<int32_t> ref = want[i].get<std::vector<int32_t>>();
    const std::vector<int32_t> got = gpt2().encode(texts[i]);
    tokens += ref.size();
    if (got != ref && ++mismatches <= 5) ADD_FAILURE() << "text " << i << " differs from the reference: \"" << texts[i] << "\"";
  }
  EXPECT_EQ(mismatches, 0u) << "of " << texts.size() << " texts";
  std::printf("compared %zu texts (%zu fortunes, %zu with non-ASCII text), %zu tokens, with tiktoken\n", texts.size(),
              n_fortunes, non_ascii, tokens);
}

TEST(Gpt2Tokenizer, BrokenFilesAreErrorsNamingTheFile) {
  const std::string dir = test::temp_dir("gpt2bad");
  auto load_error = [&](const std::string& vocab, const std::string& merges) -> std::string {
    test::write_text(dir + "/vocab.json", vocab);
    test::write_text(dir + "/merges.txt", merges);
    try {
      BpeTokenizer::load_gpt2(dir + "/vocab.json", dir + "/merges.txt");
    } catch (const std::exception& e) {
      return e.what();
    }
    return "no error";
  };
  // A tiny valid byte-level vocab: the 256 byte characters, then merges.
  nlohmann::json v;
  for (int b = 0; b < 256; ++b) {
    const uint32_t cp = gpt2_byte_to_unicode(static_cast<uint8_t>(b));
    std::string s = cp < 0x80 ? std::string(1, static_cast<char>(cp))
                              : std::string{static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
    v[s] = b;
  }
  v["ab"] = 256;
  EXPECT_EQ(load_error(v.dump(), "#version: 0.2\na b\n"), "no error");
  auto t = BpeTokenizer::load_gpt2(dir + "/vocab.json", dir + "/merges.txt");
  EXPECT_EQ(t->encode("ab"), (std::vector<int32_t>{256}));

  EXPECT_NE(load_error("{not json", "").find("vocab.json: not valid JSON"), std::string::npos);
  EXPECT_NE(load_error(v.dump(), "#version: 0.2\na c\n").find("merges.txt:2"), std::string::npos);  // "ac" not in vocab
  EXPECT_NE(load_error(v.dump(), "#version: 0.2\na b c\n").find("expected two tokens"), std::string::npos);
  nlohmann::json gap = v;
  gap["ab"] = 300;
  EXPECT_NE(load_error(gap.dump(), "").find("out of range"), std::string::npos);
  EXPECT_NE(load_error(v.dump(), "").find("no merges"), std::string::npos);
  try {
    BpeTokenizer::load_gpt2(dir + "/missing.json", dir + "/merges.txt");
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("missing.json: cannot open"), std::string::npos) << e.what();
  }
}

TEST(Tokenizer, FactoryKnowsByteAndGpt2) {
  EXPECT_EQ(make_tokenizer("byte")->name(), "byte");
  EXPECT_THROW(make_tokenizer("gpt2"), std::invalid_argument);  // no files given
  EXPECT_THROW(make_tokenizer("sentencepiece"), std::invalid_argument);
}

}  // namespace
}  // namespace flowrun
