// `flowrun prep chat`: chat or instruction data (JSONL) -> token shards and their loss mask, for
// supervised fine-tuning of a chat model.
//
//   flowrun prep chat --model FOLDER [--tokenizer PATH] [--template NAME] [--train-on assistant|all]
//                     [--max-tokens N] [--strict] [--val-fraction 0.05] [--seed 1] [--date "26 Jul 2024"]
//                     --out PREFIX FILE_OR_DIR...
//
// Each line of the inputs is one conversation, in one of the formats people write them:
//   {"messages": [{"role": "system"|"user"|"assistant", "content": "...", "reasoning_content"?: "..."}, ...]}
//                                                   OpenAI's, TRL's conversational format
//   {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}   ShareGPT
//   {"prompt": "...", "completion": "..."}          TRL's prompt-completion (strings: a user and an
//                                                   assistant message; lists: messages)
//   {"instruction": "...", "input"?: "...", "output": "..."}   Alpaca (user: the instruction, then
//                                                   a blank line and the input when there is one)
// It is rendered by the model's chat template (chat_template.hpp: the folder's, recognised by its
// text, or --template NAME), tokenized by its tokenizer.json, and written as one document of
//   PREFIX.SPLIT.{bin,idx}        the ids (Megatron indexed dataset, as prep text writes)
//   PREFIX.SPLIT.mask.{bin,idx}   uint8 per id: 1 where the id is trained on (a loss target):
//                                 the assistant's output (--train-on assistant, the default: what
//                                 TRL's assistant_only_loss trains), or every id (--train-on all)
// and PREFIX.json: {"kind": "chat", "template", "train_on", "tokenizer", "tokenizer_path",
// "vocab_size", "eot", "dtype", "documents", "tokens", "trained_tokens", "splits", "skipped":
// {reason: lines}, "lines", "seed", "val_fraction", "max_tokens", "files"}.
//
// A line that cannot be used — not JSON, no known format, a role the template does not render,
// a field of the wrong type, an empty conversation, one with nothing to train on, one longer than
// --max-tokens — is skipped, counted by reason in the summary and PREFIX.json, the first ones
// printed as FILE:LINE: what; with --strict the first one stops the prep (exit 2). The val split
// is a seeded choice of round(val_fraction * lines) lines (as prep text chooses documents). The
// outputs are written to temporary files and renamed into place once all are complete, so an
// error leaves the previous shards as they were.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "formats/chat_template.hpp"

namespace flowrun {

struct PrepChatOptions {
  std::string model;                 // a Hugging Face model folder: tokenizer.json, the chat template
  std::string tokenizer;             // a tokenizer.json or folder; "" = model's
  std::string chat_template;         // a known template's name; "" = model's
  bool train_on_all = false;         // --train-on all
  std::optional<int64_t> max_tokens;
  bool strict = false;
  double val_fraction = 0.05;
  uint64_t seed = 1;
  std::string date;                  // llama3.x's "Today Date"; "" = the template's default
  std::string out;
  std::vector<std::string> inputs;
};

struct PrepChatSummary {
  int64_t lines = 0;
  int64_t documents[2] = {0, 0};  // train, val
  int64_t tokens[2] = {0, 0};
  int64_t trained[2] = {0, 0};
  std::map<std::string, int64_t> skipped;  // reason -> lines
  std::string template_name;
  double seconds = 0;
};

// One JSONL line's conversation (the formats above). std::invalid_argument with a reason
// ("unknown role 'bot'") for a line that has none.
std::vector<ChatMessage> chat_messages_from_json(const nlohmann::json& line);

PrepChatSummary prep_chat(const PrepChatOptions& opt);
int prep_chat_command(const std::vector<std::string>& args);

}  // namespace flowrun
