// Tokenizers for text data: bytes -> token ids and back. Torch-free (used by `flowrun prep`).
//
//   ByteTokenizer   vocab 256, id = byte value; no end-of-text token.
//   BpeTokenizer    byte-level BPE: GPT-2's from vocab.json + merges.txt (the files of
//                   openai/gpt-2 and Hugging Face "gpt2", which name them encoder.json and
//                   vocab.bpe; vocab 50257, eot 50256), or a Hugging Face tokenizer.json
//                   (Llama 3, Qwen 2/3).
//
// Encoding is exact, not approximate: tests/formats/tokenizer_test.cpp compares ids with
// OpenAI's tiktoken (GPT-2) and Hugging Face `tokenizers` (Llama 3, Qwen 3) on every fortune and
// tricky strings (docs/data.md).
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
  virtual std::string name() const = 0;       // "byte", "gpt2", "tokenizer.json"
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
  // The tokens a text gets before and after its ids (a tokenizer.json's post-processor: Llama
  // 3's <|begin_of_text|> before); none by default.
  virtual const std::vector<int32_t>& specials_before() const { return kNone; }
  virtual const std::vector<int32_t>& specials_after() const { return kNone; }

 private:
  static inline const std::vector<int32_t> kNone;
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

// Byte-level BPE, the tokenizer of GPT-2, Llama 3 and Qwen 2/3: text is split into pieces (a
// pre-tokenization regex; first, with Hugging Face files, at the added tokens), each piece's bytes
// are merged by the merges' ranks into vocab ids. One class, two ways to load it:
//
//   load_gpt2(vocab.json, merges.txt)   GPT-2's own files (openai/gpt-2, Hugging Face "gpt2"):
//                                       GPT-2's regex, eot <|endoftext|> (50256), name "gpt2".
//   load_hf(tokenizer.json)             Hugging Face `tokenizers`' file, for the byte-level BPE
//                                       models ship today (tokenizer_json.cpp says which
//                                       components are read; any other is refused by name):
//                                       normalizer none or NFC; pre-tokenizer GPT-2's ByteLevel
//                                       regex or the Split regex of Llama 3 / Qwen 2-3; BPE with
//                                       merges as "A B" or [A, B], ignore_merges; added and
//                                       special tokens; the post-processor's tokens around a
//                                       text (Llama 3's <|begin_of_text|>). name "tokenizer.json".
//
// encode() gives what `tokenizers`' encode(text, add_special_tokens=False) gives: added tokens
// in the text (special or not) become their ids; invalid UTF-8 is first repaired as Python's
// bytes.decode("utf-8", "replace") (one U+FFFD per maximal ill-formed subpart; tokenizers takes
// only str). GPT-2's own files keep invalid bytes as they are (byte tokens: any bytes
// round-trip). The post-processor's tokens are added by the caller: specials_before()/after().
class BpeTokenizer : public Tokenizer {
 public:
  // Errors name the file and what is wrong (a component not implemented: by its type).
  static std::unique_ptr<BpeTokenizer> load_gpt2(const std::string& vocab_json, const std::string& merges_txt);
  // `path`: a tokenizer.json, or a folder holding one (a model folder).
  static std::unique_ptr<BpeTokenizer> load_hf(const std::string& path);

  std::string name() const override { return name_; }
  int64_t vocab_size() const override { return static_cast<int64_t>(id_to_bytes_.size()); }
  // <|endoftext|> (GPT-2, Qwen) or <|end_of_text|> (Llama 3), when the vocab has one.
  std::optional<int32_t> eot() const override { return eot_; }
  using Tokenizer::encode;
  void encode(std::string_view text, std::vector<int32_t>& out) const override;
  // Raw bytes of each id, added tokens as their text (decode(skip_special_tokens=False) without
  // the lossy UTF-8 step: an id sequence cut inside a character round-trips).
  std::string decode(const std::vector<int32_t>& ids) const override;

  // The text encode() tokenizes, byte for byte: `text` repaired and, with an NFC normalizer,
  // normalized (outside the added tokens). The bytes of the ids encode() gives concatenate to it,
  // so token i covers [sum of earlier token_bytes sizes, + its own).
  std::string normalize(std::string_view text) const;
  const std::string& token_bytes(int32_t id) const;

  // The post-processor's tokens before and after a single text (TemplateProcessing's "single").
  const std::vector<int32_t>& specials_before() const override { return before_; }
  const std::vector<int32_t>& specials_after() const override { return after_; }

  // The id of a vocab entry given as raw bytes (e.g. " the"), if there is one.
  std::optional<int32_t> token_id(std::string_view bytes) const;
  // The id of an added token by its content ("<|im_start|>"), if there is one.
  std::optional<int32_t> added_token_id(std::string_view content) const;

 private:
  BpeTokenizer() = default;

  // How the text is split into pieces before BPE.
  enum class Pretokenizer { Gpt2, Llama3 };
  struct AddedToken {
    std::string content;
    int32_t id;
    bool normalized;  // matched in the normalized text (else in the raw text, before normalizing)
  };

  // Splits `text` at the added tokens of `tokens` (leftmost, then longest, as tokenizers'
  // Aho-Corasick), calling piece(view) for the text between and token(id) for each match.
  template <class Piece, class Token>
  static void split_added(std::string_view text, const std::vector<AddedToken>& tokens, Piece piece, Token token);
  // The text as the tokenizer sees it: on_text(view) for each normalized stretch to pre-tokenize,
  // on_token(added) for each added token, in order.
  template <class Text, class Token>
  void walk(std::string_view text, Text on_text, Token on_token) const;
  void encode_normalized(std::string_view text, std::vector<int32_t>& out) const;
  // BPE of one pre-token (raw bytes) into ids, appended to `out`. Memoized: natural text
  // repeats its words, and BPE of a word is the costly part.
  void bpe(std::string_view piece, std::vector<int32_t>& out) const;
  // The loaders' shared part. add_vocab: one vocab entry (its text in GPT-2's byte-to-unicode
  // characters); finish_vocab: the byte ids and eot, once all entries are in; add_merge: the
  // next merge "A B", checked against the vocab. `where` names the file (and line) in errors.
  void add_vocab(const std::string& token, int64_t id, const std::string& where);
  void finish_vocab(const std::string& where);
  void add_merge(const std::string& a, const std::string& b, const std::string& where);

  struct Merge {
    int32_t rank;    // position in the merges list (0 = applied first)
    int32_t merged;  // id of the concatenation
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  std::string name_;
  Pretokenizer pretokenizer_ = Pretokenizer::Gpt2;
  int max_digits_ = 3;                                // Llama3: \p{N}{1,max_digits}
  bool nfc_ = false;
  bool repair_utf8_ = false;                          // invalid UTF-8 -> U+FFFD first (tokenizer.json)
  bool ignore_merges_ = false;                        // a piece that is a vocab entry stays whole
  std::vector<std::string> id_to_bytes_;              // id -> raw bytes (added tokens: content)
  std::unordered_map<std::string, int32_t> bytes_to_id_;  // the BPE vocab only
  int32_t byte_id_[256] = {};                         // id of each single byte
  std::unordered_map<uint64_t, Merge> merges_;        // (left id, right id) -> merge
  int32_t next_rank_ = 0;
  std::vector<AddedToken> added_raw_, added_normalized_;
  std::vector<int32_t> before_, after_;
  std::optional<int32_t> eot_;

  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

// `spec`: "byte", "gpt2" (with vocab.json and merges.txt), or the path of a tokenizer.json or of
// a folder holding one (a Hugging Face model folder). Throws std::invalid_argument on a bad name
// or missing files, std::runtime_error on a file that cannot be used.
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec, const std::string& vocab_json = "",
                                          const std::string& merges_txt = "");

}  // namespace flowrun
