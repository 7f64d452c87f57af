// TextTokenizer: captions -> a batch of fixed-length token ids, for frozen text encoders.
// The object behind the tokenizer nodes' `tokenizer` state port (port type `tokenizer`), held in a
// Value as std::shared_ptr<TextTokenizer>, so a sampler node can tokenize its prompts exactly as
// the training data was tokenized.
//
//   encode_texts(tokenizer, texts) (encode/tokenize.hpp) -> TensorMap
//       {"input_ids": int64 [B, max_length], "attention_mask": int64 [B, max_length] (1 = token)}
//
// Each text becomes its ids with the tokenizer's special tokens (BERT: [CLS] ... [SEP]; T5: ...
// </s>), truncated to max_length keeping the special tokens (as Hugging Face's
// truncation=True, max_length=L does), then padded on the right with the pad id.
// Implementations: WordPieceTokenizer (formats/wordpiece.hpp), SentencePieceTokenizer
// (encode/sentencepiece.hpp). Torch-free (part of the file-format library, tests/formats).
// Thread-safe: ids() is const and keeps no mutable state.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace flowrun {

class TextTokenizer {
 public:
  explicit TextTokenizer(int64_t max_length) : max_length_(max_length) {}
  virtual ~TextTokenizer() = default;
  virtual std::string name() const = 0;      // "wordpiece", "sentencepiece"
  virtual int64_t vocab_size() const = 0;    // ids are in [0, vocab_size)
  virtual int64_t pad_id() const = 0;
  // The ids of one text with the special tokens, truncated to at most `max_length` ids.
  virtual std::vector<int64_t> ids(const std::string& text, int64_t max_length) const = 0;
  // The id that ends a text ([SEP], </s>): decoders stop there.
  virtual int64_t eos_id() const = 0;
  // The text of ids, special tokens and padding dropped (as Hugging Face's
  // decode(skip_special_tokens=True)): for showing what a model generated.
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;

  int64_t max_length() const { return max_length_; }

 private:
  int64_t max_length_;
};

}  // namespace flowrun
