// TextTokenizer: captions -> a batch of fixed-length token ids, for frozen text encoders.
// The object behind the tokenize node's `tokenizer` state port (port type `tokenizer`), held in a
// Value as std::shared_ptr<TextTokenizer>, so a sampler node can tokenize its prompts exactly as
// the training data was tokenized.
//
//   encode(texts) -> TensorMap {"input_ids": int64 [B, max_length],
//                               "attention_mask": int64 [B, max_length] (1 = token, 0 = padding)}
//
// Each text becomes its ids with the tokenizer's special tokens (BERT: [CLS] ... [SEP]; T5: ...
// </s>), truncated to max_length keeping the special tokens (as Hugging Face's
// truncation=True, max_length=L does), then padded on the right with the pad id.
// Implementations: WordPieceTokenizer (encode/wordpiece.hpp), SentencePieceTokenizer
// (encode/sentencepiece.hpp). Thread-safe: encode() is const and keeps no mutable state.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/tensor_map.hpp"

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

  int64_t max_length() const { return max_length_; }
  // One row per text: {"input_ids", "attention_mask"}, both int64 [texts.size(), max_length()].
  TensorMap encode(const std::vector<std::string>& texts) const {
    const int64_t B = static_cast<int64_t>(texts.size()), L = max_length_;
    torch::Tensor input_ids = torch::full({B, L}, pad_id(), torch::kInt64);
    torch::Tensor mask = torch::zeros({B, L}, torch::kInt64);
    auto ia = input_ids.accessor<int64_t, 2>();
    auto ma = mask.accessor<int64_t, 2>();
    for (int64_t b = 0; b < B; ++b) {
      const std::vector<int64_t> row = ids(texts[static_cast<size_t>(b)], L);
      for (size_t i = 0; i < row.size() && static_cast<int64_t>(i) < L; ++i) {
        ia[b][static_cast<int64_t>(i)] = row[i];
        ma[b][static_cast<int64_t>(i)] = 1;
      }
    }
    return {{"input_ids", input_ids}, {"attention_mask", mask}};
  }

 private:
  int64_t max_length_;
};

}  // namespace flowrun
