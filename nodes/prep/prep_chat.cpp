// `flowrun prep chat`: see prep_chat.hpp. Two passes over the inputs, as prep text: the first
// counts the lines (the val split is drawn from the count), the second renders, tokenizes and
// writes each conversation to its split.
#include "prep/prep_chat.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <stdexcept>

#include "common/seed.hpp"
#include "data/shuffle.hpp"
#include "formats/files.hpp"
#include "formats/indexed_dataset.hpp"
#include "formats/json_file.hpp"
#include "formats/tokenizer.hpp"
#include "prep/cli_args.hpp"

namespace fs = std::filesystem;

namespace flowrun {
namespace {

const char* kChatUsage =
    "usage: flowrun prep chat --model FOLDER [--tokenizer PATH] [--template NAME] [--train-on assistant|all]\n"
    "                         [--max-tokens N] [--strict] [--val-fraction 0.05] [--seed 1] [--date \"26 Jul 2024\"]\n"
    "                         --out PREFIX FILE_OR_DIR...\n"
    "\n"
    "Chat or instruction data (JSONL, a conversation per line) -> token shards and their loss mask:\n"
    "  PREFIX.{train,val}.{bin,idx}       the ids of each conversation, rendered by the model's chat template\n"
    "  PREFIX.{train,val}.mask.{bin,idx}  1 per id trained on (the assistant's output), else 0\n"
    "  PREFIX.json                        template, tokenizer, counts, lines skipped by reason\n"
    "\n"
    "Line formats: {\"messages\": [{\"role\", \"content\"}...]} (OpenAI, TRL), {\"conversations\": [{\"from\", \"value\"}...]}\n"
    "(ShareGPT), {\"prompt\", \"completion\"} (TRL), {\"instruction\", \"input\", \"output\"} (Alpaca).\n"
    "\n"
    "  --model FOLDER        a Hugging Face model folder: its tokenizer.json and its chat template\n"
    "  --tokenizer PATH      another tokenizer.json (or folder) than the model's\n"
    "  --template NAME       a known template instead of the folder's: llama3, llama3.1, llama3.2, qwen2.5,\n"
    "                        qwen2.5-training, qwen3, qwen3-training\n"
    "  --train-on WHAT       assistant (default): the loss on the assistant's output only; all: on every token\n"
    "  --max-tokens N        a conversation longer than N ids is a bad line (N: the sequence length it will train at)\n"
    "  --strict              stop at the first bad line (exit 2) instead of skipping it\n"
    "  --val-fraction F      share of lines held out for val, chosen by a seeded shuffle (default 0.05)\n"
    "  --seed N              seed of that shuffle (default 1)\n"
    "  --date D              llama3.1/3.2's \"Today Date\" (default: 26 Jul 2024 for 3.1, today for 3.2, as transformers)\n";

// A line that cannot be used: `reason` is the summary's key, what() the message.
struct BadLine : std::invalid_argument {
  BadLine(std::string why, const std::string& what) : std::invalid_argument(what), reason(std::move(why)) {}
  std::string reason;
};

std::string string_field(const nlohmann::json& obj, const char* key, const std::string& where) {
  const auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) throw BadLine("missing field", where + ": no \"" + key + "\"");
  if (!it->is_string())
    throw BadLine("bad field", where + ": \"" + key + "\" is " + it->type_name() + ", not a string" +
                                   (it->is_array() ? " (content as a list of parts is not supported)" : ""));
  return it->get<std::string>();
}

std::vector<ChatMessage> messages_of(const nlohmann::json& list, const char* role_key, const char* content_key, const char* what) {
  if (!list.is_array()) throw BadLine("bad field", std::string("\"") + what + "\" is not a list");
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string where = std::string(what) + "[" + std::to_string(i) + "]";
    if (!list[i].is_object()) throw BadLine("bad field", where + " is not an object");
    std::string role = string_field(list[i], role_key, where);
    if (std::string(role_key) == "from") {  // ShareGPT's names
      if (role == "human") role = "user";
      if (role == "gpt") role = "assistant";
    }
    if (role != "system" && role != "user" && role != "assistant")
      throw BadLine("unknown role", where + ": role '" + role + "' (known: system, user, assistant" +
                                        (std::string(role_key) == "from" ? "; ShareGPT's human, gpt" : "") + ")");
    ChatMessage m{role, string_field(list[i], content_key, where), std::nullopt};
    if (list[i].contains("reasoning_content") && !list[i]["reasoning_content"].is_null())
      m.reasoning = string_field(list[i], "reasoning_content", where);
    if (list[i].contains("tool_calls") && !list[i]["tool_calls"].is_null())
      throw BadLine("tool calls", where + ": tool calls are not supported yet");
    out.push_back(std::move(m));
  }
  return out;
}

}  // namespace

std::vector<ChatMessage> chat_messages_from_json(const nlohmann::json& line) {
  if (!line.is_object()) throw BadLine("no known format", "not a JSON object");
  std::vector<ChatMessage> out;
  if (line.contains("messages")) {
    out = messages_of(line["messages"], "role", "content", "messages");
  } else if (line.contains("conversations")) {
    out = messages_of(line["conversations"], "from", "value", "conversations");
  } else if (line.contains("prompt") && line.contains("completion")) {
    if (line["prompt"].is_array() && line["completion"].is_array()) {
      out = messages_of(line["prompt"], "role", "content", "prompt");
      for (ChatMessage& m : messages_of(line["completion"], "role", "content", "completion")) out.push_back(std::move(m));
    } else {
      out = {{"user", string_field(line, "prompt", "the line"), std::nullopt},
             {"assistant", string_field(line, "completion", "the line"), std::nullopt}};
    }
  } else if (line.contains("instruction") && line.contains("output")) {
    std::string user = string_field(line, "instruction", "the line");
    if (line.contains("input") && !line["input"].is_null()) {
      const std::string input = string_field(line, "input", "the line");
      if (!input.empty()) user += "\n\n" + input;
    }
    out = {{"user", user, std::nullopt}, {"assistant", string_field(line, "output", "the line"), std::nullopt}};
  } else {
    std::string keys;
    for (const auto& [k, v] : line.items()) keys += (keys.empty() ? "" : ", ") + k;
    throw BadLine("no known format", "no \"messages\", \"conversations\", \"prompt\"/\"completion\" or \"instruction\"/\"output\" "
                                     "(keys: " + keys + ")");
  }
  if (out.empty()) throw BadLine("empty conversation", "an empty conversation");
  return out;
}

PrepChatSummary prep_chat(const PrepChatOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  if (opt.out.empty()) throw std::invalid_argument("--out PREFIX is required");
  if (opt.inputs.empty()) throw std::invalid_argument("no input files given");
  if (opt.model.empty() && (opt.tokenizer.empty() || opt.chat_template.empty()))
    throw std::invalid_argument("--model FOLDER is required (or both --tokenizer and --template)");
  if (!(opt.val_fraction >= 0 && opt.val_fraction < 1))
    throw std::invalid_argument("--val-fraction must be in [0, 1), got " + std::to_string(opt.val_fraction));
  if (opt.max_tokens && *opt.max_tokens < 2) throw std::invalid_argument("--max-tokens must be at least 2");

  // The model's tokenizer and template (a flag overrides either).
  std::unique_ptr<BpeTokenizer> tok;
  std::unique_ptr<ChatTemplate> tmpl;
  try {
    const std::string tok_path = opt.tokenizer.empty() ? opt.model : opt.tokenizer;
    tok = BpeTokenizer::load_hf(tok_path);
    tmpl = opt.chat_template.empty() ? ChatTemplate::from_folder(opt.model) : ChatTemplate::named(opt.chat_template);
  } catch (const std::runtime_error& e) {
    throw std::invalid_argument(e.what());
  }
  const std::vector<std::string> files = expand_input_files(opt.inputs);
  // Calls fn(file, line number, text) for each non-blank line.
  auto for_each_line = [&](const std::function<void(const std::string&, int64_t, std::string_view)>& fn) {
    for (const std::string& f : files) {
      const auto mapped = map_input_file(f);
      const std::string_view text(reinterpret_cast<const char*>(mapped->data()), mapped->size());
      int64_t line_no = 0;
      for (size_t pos = 0; pos < text.size();) {
        size_t eol = text.find('\n', pos);
        if (eol == std::string_view::npos) eol = text.size();
        std::string_view line = text.substr(pos, eol - pos);
        ++line_no;
        pos = eol + 1;
        if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
        fn(f, line_no, line);
      }
    }
  };

  // Pass 1: count the lines, choose the val ones.
  PrepChatSummary s;
  for_each_line([&](const std::string&, int64_t, std::string_view) { ++s.lines; });
  if (s.lines == 0) throw std::invalid_argument("the inputs hold no lines (all empty or blank)");
  int64_t n_val = 0;
  if (opt.val_fraction > 0) {
    if (s.lines < 2) throw std::invalid_argument("only 1 line: nothing left to train on after holding out val (--val-fraction 0)");
    n_val = std::clamp<int64_t>(std::llround(opt.val_fraction * static_cast<double>(s.lines)), 1, s.lines - 1);
  }
  std::vector<bool> is_val(static_cast<size_t>(s.lines), false);
  const std::vector<int64_t> perm = seeded_permutation(s.lines, mix_seed({opt.seed, kSeedTagValSplit}));
  for (int64_t k = 0; k < n_val; ++k) is_val[static_cast<size_t>(perm[static_cast<size_t>(k)])] = true;

  // Pass 2: each line -> a conversation -> ids and mask, into its split.
  const fs::path parent = fs::path(opt.out).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    fs::create_directories(parent, ec);
    if (ec) throw std::runtime_error(parent.string() + ": cannot create: " + ec.message());
  }
  const TokenDtype dtype = dtype_for_vocab(tok->vocab_size());
  IndexedDatasetWriter ids_out[2] = {{opt.out + ".train", dtype}, {opt.out + ".val", dtype}};
  IndexedDatasetWriter mask_out[2] = {{opt.out + ".train.mask", TokenDtype::UInt8}, {opt.out + ".val.mask", TokenDtype::UInt8}};
  ChatOptions copt;
  copt.date = opt.date;
  s.template_name = tmpl->name();
  int64_t index = 0, reported = 0;
  std::vector<int32_t> mask32;
  for_each_line([&](const std::string& file, int64_t line_no, std::string_view line) {
    const int split = is_val[static_cast<size_t>(index++)] ? 1 : 0;
    const std::string where = file + ":" + std::to_string(line_no);
    try {
      nlohmann::json j;
      try {
        j = parse_json_strict(std::string(line), where);
      } catch (const std::exception& e) {
        throw BadLine("not JSON", e.what());
      }
      std::vector<ChatMessage> messages = chat_messages_from_json(j);
      ChatTokens t;
      try {
        t = tokenize_chat(*tmpl, *tok, std::move(messages), copt);
      } catch (const std::invalid_argument& e) {
        throw BadLine("unknown role", e.what());
      }
      if (opt.train_on_all) std::fill(t.assistant.begin(), t.assistant.end(), 1);
      const int64_t trained = std::count(t.assistant.begin(), t.assistant.end(), 1);
      if (trained == 0) throw BadLine("nothing to train on", "no assistant message to train on (or --train-on all)");
      if (opt.max_tokens && static_cast<int64_t>(t.ids.size()) > *opt.max_tokens)
        throw BadLine("longer than --max-tokens", std::to_string(t.ids.size()) + " ids, more than --max-tokens " +
                                                      std::to_string(*opt.max_tokens));
      ids_out[split].add_document(t.ids);
      mask32.assign(t.assistant.begin(), t.assistant.end());
      mask_out[split].add_document(mask32);
      s.trained[split] += trained;
    } catch (const BadLine& e) {
      const std::string msg = e.what();
      const std::string full = msg.rfind(where, 0) == 0 ? msg : where + ": " + msg;
      if (opt.strict) throw std::invalid_argument(full + " (--strict: stopped; without it the line is skipped)");
      ++s.skipped[e.reason];
      if (reported++ < 10) std::fprintf(stderr, "prep chat: skipped %s\n", full.c_str());
    }
  });
  const int64_t kept = s.lines - [&] { int64_t n = 0; for (const auto& [k, v] : s.skipped) n += v; return n; }();
  if (ids_out[0].documents() == 0)
    throw std::invalid_argument("no conversation left to train on (" + std::to_string(kept) + " of " + std::to_string(s.lines) +
                                " lines usable, all held out or none); nothing was written");
  for (int k = 0; k < 2; ++k) {
    s.documents[k] = ids_out[k].documents();
    s.tokens[k] = ids_out[k].tokens();
  }
  for (int k = 0; k < 2; ++k) ids_out[k].finish(), mask_out[k].finish();

  nlohmann::json j;
  j["kind"] = "chat";
  j["template"] = s.template_name;
  j["train_on"] = opt.train_on_all ? "all" : "assistant";
  j["tokenizer"] = tok->name();
  j["tokenizer_path"] = opt.tokenizer.empty() ? opt.model : opt.tokenizer;
  j["vocab_size"] = tok->vocab_size();
  j["eot"] = tok->eot() ? nlohmann::json(*tok->eot()) : nlohmann::json(nullptr);
  j["dtype"] = dtype_name(dtype);
  j["documents"] = s.documents[0] + s.documents[1];
  j["tokens"] = s.tokens[0] + s.tokens[1];
  j["trained_tokens"] = s.trained[0] + s.trained[1];
  j["splits"] = {{"train", {{"documents", s.documents[0]}, {"tokens", s.tokens[0]}, {"trained_tokens", s.trained[0]}}},
                 {"val", {{"documents", s.documents[1]}, {"tokens", s.tokens[1]}, {"trained_tokens", s.trained[1]}}}};
  j["skipped"] = s.skipped;
  j["lines"] = s.lines;
  j["seed"] = opt.seed;
  j["val_fraction"] = opt.val_fraction;
  j["max_tokens"] = opt.max_tokens ? nlohmann::json(*opt.max_tokens) : nlohmann::json(nullptr);
  j["files"] = files.size();
  write_file_atomic(opt.out + ".json", j.dump(2) + "\n");
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return s;
}

int prep_chat_command(const std::vector<std::string>& args) {
  PrepChatOptions opt;
  return run_cli_command("prep chat", kChatUsage, args, [&](const CliArgs& cl) {
    opt.inputs = cl.positional;
    for (const auto& [a, v] : cl.options) {
      if (a == "--model") {
        opt.model = v;
      } else if (a == "--tokenizer") {
        opt.tokenizer = v;
      } else if (a == "--template") {
        opt.chat_template = v;
      } else if (a == "--train-on") {
        if (v != "assistant" && v != "all") throw std::invalid_argument("--train-on: '" + v + "' (assistant or all)");
        opt.train_on_all = v == "all";
      } else if (a == "--max-tokens") {
        opt.max_tokens = static_cast<int64_t>(cli_uint(a, v));
      } else if (a == "--strict") {
        opt.strict = true;
      } else if (a == "--val-fraction") {
        opt.val_fraction = cli_number(a, v);
      } else if (a == "--seed") {
        opt.seed = cli_uint(a, v);
      } else if (a == "--date") {
        opt.date = v;
      } else if (a == "--out") {
        opt.out = v;
      } else {
        throw std::invalid_argument("unknown option " + a);
      }
    }
    const PrepChatSummary s = prep_chat(opt);
    int64_t skipped = 0;
    for (const auto& [k, v] : s.skipped) skipped += v;
    std::printf("prep chat: %lld lines -> %lld conversations, template %s; %.2f s\n", static_cast<long long>(s.lines),
                static_cast<long long>(s.documents[0] + s.documents[1]), s.template_name.c_str(), s.seconds);
    const char* names[2] = {"train", "val"};
    for (int k = 0; k < 2; ++k)
      std::printf("  %s.%s.{bin,idx} + .mask: %lld conversations, %lld tokens, %lld trained on\n", opt.out.c_str(), names[k],
                  static_cast<long long>(s.documents[k]), static_cast<long long>(s.tokens[k]), static_cast<long long>(s.trained[k]));
    if (skipped) {
      std::printf("  skipped %lld lines:", static_cast<long long>(skipped));
      for (const auto& [k, v] : s.skipped) std::printf(" %s %lld;", k.c_str(), static_cast<long long>(v));
      std::printf(" (the first ones are named above; --strict stops at the first)\n");
    }
    std::printf("  %s.json\n", opt.out.c_str());
    return 0;
  }, {"--strict"});
}

}  // namespace flowrun
