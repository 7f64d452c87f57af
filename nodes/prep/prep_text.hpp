// `flowrun prep text`: text files -> token shards for the token_shards node.
//
//   flowrun prep text --tokenizer byte|gpt2|TOKENIZER_JSON|MODEL_FOLDER [--vocab vocab.json --merges merges.txt]
//                     [--val-fraction 0.05] [--seed 1] [--split-on %] --out PREFIX FILE_OR_DIR...
//
// Writes PREFIX.train.{bin,idx} and PREFIX.val.{bin,idx} (Megatron indexed datasets, one
// sequence per document, uint16 tokens for a vocab under 65,500, else int32: Megatron's rule) and PREFIX.json:
//   {"tokenizer": "gpt2", "vocab_size": 50257, "eot": 50256, "dtype": "uint16",
//    "documents": n, "tokens": n, "splits": {"train": {"documents": n, "tokens": n}, "val": {...}},
//    "seed": 1, "val_fraction": 0.05, "split_on": "%", "files": n}
// (the vocab size a model needs is there: Megatron's files have no place for it).
//
// Documents: one per input file (directories: their regular files, recursively, sorted by
// path; hidden names skipped), or with --split-on S, the parts of each file between lines
// that are exactly S (fortune files: "%"). Whitespace-only documents are dropped. A seeded
// shuffle of the documents picks round(val_fraction * documents) of them (at least 1 when the
// fraction is > 0) for val; both splits keep the documents in input order. gpt2 appends its
// end-of-text token (50256) to every document, as Megatron's preprocess_data.py --append-eod,
// so documents are separated by it in the token stream; the byte tokenizer has no such token
// and writes the text as is. A tokenizer.json's documents are its post-processor's tokens (Llama
// 3: <|begin_of_text|>), the text's ids, then the end-of-text token (<|end_of_text|> for Llama 3,
// <|endoftext|> for Qwen); PREFIX.json gets "tokenizer_path".
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace flowrun {

struct PrepTextOptions {
  std::string tokenizer;             // "byte", "gpt2" or a tokenizer.json / model folder (make_tokenizer)
  std::string vocab, merges;         // gpt2's vocab.json and merges.txt
  double val_fraction = 0.05;        // in [0, 1)
  uint64_t seed = 1;
  std::optional<std::string> split_on;
  std::string out;                   // PREFIX
  std::vector<std::string> inputs;   // files or directories
};

struct PrepTextSummary {
  int64_t files = 0;
  int64_t documents[2] = {0, 0};  // train, val
  int64_t tokens[2] = {0, 0};
  int64_t bytes = 0;              // text read
  int64_t vocab_size = 0;
  double seconds = 0;
  double load_seconds = 0;        // of which loading the tokenizer
  double encode_seconds = 0;      // of which encoding (the tokenizer's calls alone)
};

// Throws std::invalid_argument for bad options or unusable inputs (missing files, no
// documents, broken vocab files), std::runtime_error for failures while writing.
PrepTextSummary prep_text(const PrepTextOptions& opt);

// The command line: parses args (after "prep text"), runs, prints the summary. Exit code.
int prep_text_command(const std::vector<std::string>& args);

}  // namespace flowrun
