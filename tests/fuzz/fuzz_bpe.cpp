// GPT-2 byte-level BPE. First input byte even: the rest is text, encoded with a small vocab
// (the 256 byte tokens and a few merges) and decoded back, which must give the text again
// (byte-level BPE is lossless for any bytes). Odd: the rest is "vocab.json NUL merges.txt",
// loaded (errors name the file) and, if accepted, used the same way on a fixed text.
#include <stdexcept>
#include <string>
#include <vector>

#include "formats/tokenizer.hpp"
#include "fuzz_util.hpp"

using namespace flowrun;

namespace {

// The byte tokens as GPT-2's vocab.json writes them, plus merged tokens, and their merges.
const BpeTokenizer& small_bpe() {
  static const std::unique_ptr<BpeTokenizer> tok = [] {
    auto unicode = [](unsigned char b) {
      const uint32_t u = gpt2_byte_to_unicode(b);
      std::string s;  // UTF-8 of u (< 0x800)
      if (u < 0x80) s += static_cast<char>(u);
      else s += static_cast<char>(0xC0 | (u >> 6)), s += static_cast<char>(0x80 | (u & 0x3F));
      return s;
    };
    auto json_string = [](const std::string& s) {
      std::string o = "\"";
      for (char c : s) {
        if (c == '"' || c == '\\') o += '\\';
        o += c;
      }
      return o + "\"";
    };
    std::vector<std::string> tokens;
    for (int b = 0; b < 256; ++b) tokens.push_back(unicode(static_cast<unsigned char>(b)));
    const std::vector<std::pair<std::string, std::string>> merges = {
        {unicode(' '), "t"}, {"h", "e"}, {unicode(' ') + "t", "he"}, {"i", "n"}, {"in", "g"}, {"a", "t"}};
    for (const auto& [a, b] : merges) tokens.push_back(a + b);
    tokens.push_back("<|endoftext|>");
    std::string vocab = "{";
    for (size_t i = 0; i < tokens.size(); ++i)
      vocab += (i ? ", " : "") + json_string(tokens[i]) + ": " + std::to_string(i);
    vocab += "}";
    std::string merges_txt = "#version: 0.2\n";
    for (const auto& [a, b] : merges) merges_txt += a + " " + b + "\n";
    return BpeTokenizer::load_gpt2(fuzz::write("small_vocab.json", vocab), fuzz::write("small_merges.txt", merges_txt));
  }();
  return *tok;
}

void round_trip(const BpeTokenizer& tok, const std::string& text) {
  const std::vector<int32_t> ids = tok.encode(text);
  for (int32_t id : ids) FUZZ_CHECK(id >= 0 && id < tok.vocab_size());
  FUZZ_CHECK(tok.decode(ids) == text);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    round_trip(small_bpe(), rest);
    return 0;
  }
  const size_t nul = rest.find('\0');
  const std::string vocab = fuzz::write("vocab.json", rest.substr(0, nul));
  const std::string merges = fuzz::write("merges.txt", nul == std::string::npos ? "" : rest.substr(nul + 1));
  try {
    const auto tok = BpeTokenizer::load_gpt2(vocab, merges);
    round_trip(*tok, "Hello world, the thing\n\xe4\xb8\xad\xff");
  } catch (const std::runtime_error&) {
  }
  return 0;
}
