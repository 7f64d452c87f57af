// Tokenizers for text data: bytes -> token ids and back. Torch-free (used by `flowrun prep`).
//
//   ByteTokenizer   vocab 256, id = byte value; no end-of-text token.
//   Gpt2Tokenizer   GPT-2's byte-level BPE from vocab.json + merges.txt (the files of
//                   openai/gpt-2 and Hugging Face "gpt2", which name them encoder.json and
//                   vocab.bpe). vocab 50257, eot 50256.
//
// Encoding is exact, not approximate: tests/formats/tokenizer_test.cpp compares ids with
// OpenAI's tiktoken on every fortune and tricky strings (docs/data.md).
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace flowrun {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string name() const = 0;       // "byte", "gpt2"
  virtual int64_t vocab_size() const = 0;     // ids are in [0, vocab_size)
  virtual std::optional<int32_t> eot() const = 0;  // end-of-text id, if the vocab has one
  // Appends the ids of `text` (any bytes; invalid UTF-8 is encoded byte by byte) to `out`.
  virtual void encode(std::string_view text, std::vector<int32_t>& out) const = 0;
  std::vector<int32_t> encode(std::string_view text) const {
    std::vector<int32_t> out;
    encode(text, out);
    return out;
  }
  // The bytes the ids stand for (the eot token decodes to "<|endoftext|>"); throws on an id
  // outside the vocab.
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
};

class ByteTokenizer : public Tokenizer {
 public:
  std::string name() const override { return "byte"; }
  int64_t vocab_size() const override { return 256; }
  std::optional<int32_t> eot() const override { return std::nullopt; }
  using Tokenizer::encode;  // the returning overload too
  void encode(std::string_view text, std::vector<int32_t>& out) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
};

// GPT-2's pre-tokenization: splits text at the matches of
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// (leftmost-first alternation, as Python's `regex` and JavaScript evaluate it), with Unicode
// letters/numbers from ICU and \s = the Unicode White_Space property. The pieces are views of
// `text` and cover it exactly, in order.
std::vector<std::string_view> gpt2_pretokenize(std::string_view text);

// Llama 3's and Qwen 2/3's pre-tokenization, the Split regex of their tokenizer.json:
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
// with \p{N}{1,3} for Llama 3 (max_digits 3) and \p{N} for Qwen (max_digits 1); the classes as
// gpt2_pretokenize's. The pieces cover `text` exactly, in order. (Checked against the
// `tokenizers` library: tests/formats/tokenizer_test.cpp.)
std::vector<std::string_view> llama3_pretokenize(std::string_view text, int max_digits);

// GPT-2's bytes_to_unicode(): the printable character each byte is written as in vocab.json
// and merges.txt (e.g. ' ' -> U+0120 'Ġ'), as a code point.
uint32_t gpt2_byte_to_unicode(uint8_t b);

class Gpt2Tokenizer : public Tokenizer {
 public:
  // Reads GPT-2's vocab.json (token string -> id) and merges.txt ("#version" line, then one
  // "A B" merge per line, highest priority first). Errors name the file and what is wrong.
  static std::unique_ptr<Gpt2Tokenizer> load(const std::string& vocab_json, const std::string& merges_txt);

  std::string name() const override { return "gpt2"; }
  int64_t vocab_size() const override { return static_cast<int64_t>(id_to_bytes_.size()); }
  std::optional<int32_t> eot() const override { return eot_; }
  using Tokenizer::encode;
  void encode(std::string_view text, std::vector<int32_t>& out) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;

  // The token id of a vocab entry given as raw bytes (e.g. " the"), if there is one.
  std::optional<int32_t> token_id(std::string_view bytes) const;

 private:
  Gpt2Tokenizer() = default;
  // BPE of one pre-token (raw bytes) into ids, appended to `out`. Memoized: natural text
  // repeats its words, and BPE of a word is the costly part.
  void bpe(std::string_view piece, std::vector<int32_t>& out) const;

  struct Merge {
    int32_t rank;    // line number in merges.txt (0 = applied first)
    int32_t merged;  // id of the concatenation
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  std::vector<std::string> id_to_bytes_;              // id -> raw bytes
  std::unordered_map<std::string, int32_t> bytes_to_id_;
  int32_t byte_id_[256] = {};                         // id of each single byte
  std::unordered_map<uint64_t, Merge> merges_;        // (left id, right id) -> merge
  std::optional<int32_t> eot_;

  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

// "byte" or "gpt2" (gpt2 needs both files). Throws std::invalid_argument on a bad name.
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& name, const std::string& vocab_json = "",
                                          const std::string& merges_txt = "");

}  // namespace flowrun
