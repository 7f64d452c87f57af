// A Hugging Face tokenizer.json as a BpeTokenizer (tokenizer.hpp). What is read, component by
// component, in tokenizers' serialization (Llama 3's, Qwen 2/3's and GPT-2's files):
//
//   normalizer      null, or NFC
//   pre_tokenizer   ByteLevel with use_regex (GPT-2's regex), or
//                   Sequence[Split(Regex R, "Isolated"), ByteLevel without use_regex], R being
//                   Llama 3's regex (\p{N}{1,3}) or Qwen 2/3's (\p{N}), character for character
//   model           BPE: vocab, merges ("A B" or ["A", "B"]), ignore_merges
//   added_tokens    id, content, special, normalized (lstrip, rstrip, single_word must be false)
//   post_processor  null, ByteLevel, TemplateProcessing (the special tokens its "single"
//                   template puts around $A), or a Sequence of these
//   decoder         null or ByteLevel
//
// Anything else is refused naming the key and its type: SentencePiece-style BPE (Llama 2,
// Mistral: a Metaspace pre-tokenizer or Prepend/Replace normalizer, byte_fallback) is one. A
// refusal is the place to add a component: docs/data.md says how.
#include <filesystem>
#include <string>

#include "formats/json_file.hpp"
#include "formats/tokenizer.hpp"

namespace flowrun {
namespace {

// The Split regexes recognised (tokenizers' files spell them this way), and their \p{N} run.
const char* const kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::string type_of(const nlohmann::json& j) {
  return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>() : j.dump().substr(0, 60);
}

[[noreturn]] void refuse(const std::string& file, const std::string& key, const std::string& what) {
  throw std::runtime_error(file + ": " + key + ": " + what +
                           " (flowrun reads the byte-level BPE tokenizer.json of GPT-2, Llama 3 and Qwen 2/3; docs/data.md)");
}

bool flag(const nlohmann::json& j, const std::string& file, const std::string& key, bool fallback) {
  return json_value<bool>(j, file, key, fallback);
}

// The ByteLevel step of a pre-tokenizer: bytes to GPT-2's characters, with GPT-2's regex before
// (use_regex) or not (after a Split).
void check_byte_level(const nlohmann::json& j, const std::string& where, bool use_regex) {
  if (flag(j, where, "add_prefix_space", false)) refuse(where, "add_prefix_space", "true is not implemented (a space before the text)");
  if (flag(j, where, "use_regex", true) != use_regex)
    refuse(where, "use_regex", use_regex ? "false without a Split before it is not implemented"
                                         : "true after a Split (splitting twice) is not implemented");
}

}  // namespace

std::unique_ptr<BpeTokenizer> BpeTokenizer::load_hf(const std::string& path) {
  std::error_code ec;
  const std::string file = std::filesystem::is_directory(path, ec) ? (std::filesystem::path(path) / "tokenizer.json").string() : path;
  if (file != path && !std::filesystem::is_regular_file(file, ec))
    throw std::invalid_argument("tokenizer folder " + path + " has no tokenizer.json (a Hugging Face model folder has one)");
  const nlohmann::json j = read_json_file(file, uint64_t{256} << 20);
  if (!j.is_object()) refuse(file, "(top)", "not a JSON object");
  std::unique_ptr<BpeTokenizer> t(new BpeTokenizer());
  t->name_ = "tokenizer.json";
  t->repair_utf8_ = true;  // tokenizers takes str: Python's decode("utf-8", "replace") before it

  // normalizer
  if (auto n = j.find("normalizer"); n != j.end() && !n->is_null()) {
    if (type_of(*n) != "NFC") refuse(file, "normalizer", "'" + type_of(*n) + "' is not implemented (null or NFC are)");
    t->nfc_ = true;
  }

  // pre_tokenizer
  const nlohmann::json pre = j.value("pre_tokenizer", nlohmann::json());
  if (type_of(pre) == "ByteLevel") {
    check_byte_level(pre, file + ": pre_tokenizer", true);
    t->pretokenizer_ = Pretokenizer::Gpt2;
  } else if (type_of(pre) == "Sequence" && pre.contains("pretokenizers") && pre["pretokenizers"].size() == 2 &&
             type_of(pre["pretokenizers"][0]) == "Split" && type_of(pre["pretokenizers"][1]) == "ByteLevel") {
    const nlohmann::json& split = pre["pretokenizers"][0];
    const std::string key = "pre_tokenizer.pretokenizers[0]";
    const std::string regex = split.contains("pattern") && split["pattern"].is_object() && split["pattern"].contains("Regex")
                                  ? split["pattern"]["Regex"].get<std::string>()
                                  : "";
    if (regex == kLlama3Regex) {
      t->max_digits_ = 3;
    } else if (regex == kQwen2Regex) {
      t->max_digits_ = 1;
    } else {
      refuse(file, key + ".pattern", "a Split regex other than Llama 3's and Qwen 2/3's is not implemented: " +
                                         split.value("pattern", nlohmann::json()).dump().substr(0, 120));
    }
    if (split.value("behavior", "") != "Isolated" || split.value("invert", false))
      refuse(file, key, "a Split with behavior '" + split.value("behavior", "") + "' or invert is not implemented (Isolated is)");
    t->pretokenizer_ = Pretokenizer::Llama3;
    check_byte_level(pre["pretokenizers"][1], file + ": pre_tokenizer.pretokenizers[1]", false);
  } else {
    refuse(file, "pre_tokenizer", "'" + type_of(pre) +
                                      "' is not implemented (ByteLevel, or a Sequence of Split with Llama 3's or Qwen's regex "
                                      "and ByteLevel); SentencePiece-style files (Metaspace) are not byte-level BPE");
  }

  // decoder
  if (auto d = j.find("decoder"); d != j.end() && !d->is_null() && type_of(*d) != "ByteLevel")
    refuse(file, "decoder", "'" + type_of(*d) + "' is not implemented (ByteLevel is)");

  // model: vocab and merges
  const nlohmann::json& model = j.contains("model") ? j["model"] : nlohmann::json();
  if (type_of(model) != "BPE") refuse(file, "model", "'" + type_of(model) + "' is not implemented (BPE is)");
  if (flag(model, file + ": model", "byte_fallback", false))
    refuse(file, "model.byte_fallback", "true (SentencePiece-style BPE, as Llama 2 and Mistral ship) is not implemented");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (!json_value<std::string>(model, file + ": model", key, "").empty())
      refuse(file, std::string("model.") + key, "'" + model[key].get<std::string>() + "' is not implemented (none is)");
  if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() != 0.0)
    refuse(file, "model.dropout", "BPE dropout is for training a tokenizer; not implemented");
  t->ignore_merges_ = flag(model, file + ": model", "ignore_merges", false);
  if (!model.contains("vocab") || !model["vocab"].is_object() || model["vocab"].empty())
    refuse(file, "model.vocab", "missing or empty (expected {token: id})");
  for (auto it = model["vocab"].begin(); it != model["vocab"].end(); ++it) {
    if (!it.value().is_number_integer()) refuse(file, "model.vocab['" + it.key() + "']", "the id is not an integer");
    t->add_vocab(it.key(), it.value().get<int64_t>(), file + ": model.vocab");
  }
  t->finish_vocab(file + ": model.vocab");
  if (!model.contains("merges") || !model["merges"].is_array()) refuse(file, "model.merges", "missing (expected a list)");
  const auto& merges = model["merges"];
  for (size_t i = 0; i < merges.size(); ++i) {
    const std::string where = file + ": model.merges[" + std::to_string(i) + "]";
    const auto& m = merges[i];
    if (m.is_string()) {  // "A B" (tokenizers before 0.20)
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
        throw std::runtime_error(where + ": expected two tokens 'A B', got '" + s + "'");
      t->add_merge(s.substr(0, space), s.substr(space + 1), where);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {  // ["A", "B"]
      t->add_merge(m[0].get<std::string>(), m[1].get<std::string>(), where);
    } else {
      throw std::runtime_error(where + ": expected \"A B\" or [\"A\", \"B\"], got " + m.dump().substr(0, 60));
    }
  }

  // added_tokens: their own ids (most lie past the BPE vocab; one that is also a vocab entry
  // keeps the vocab's bytes, which are its content)
  if (auto a = j.find("added_tokens"); a != j.end() && !a->is_null()) {
    if (!a->is_array()) refuse(file, "added_tokens", "expected a list");
    for (size_t i = 0; i < a->size(); ++i) {
      const auto& tok = (*a)[i];
      const std::string key = "added_tokens[" + std::to_string(i) + "]";
      const std::string where = file + ": " + key;
      const std::string content = json_value<std::string>(tok, where, "content", "");
      const int64_t id = json_value<int64_t>(tok, where, "id", -1);
      if (content.empty() || id < 0) refuse(file, key, "needs a content and an id >= 0");
      for (const char* f : {"lstrip", "rstrip", "single_word"})
        if (flag(tok, where, f, false)) refuse(file, key + "." + f, "true is not implemented ('" + content + "')");
      const bool normalized = flag(tok, where, "normalized", !flag(tok, where, "special", false));
      if (static_cast<size_t>(id) >= t->id_to_bytes_.size()) t->id_to_bytes_.resize(id + 1);
      if (!t->id_to_bytes_[id].empty() && t->id_to_bytes_[id] != content)
        refuse(file, key, "id " + std::to_string(id) + " is '" + content + "' here and another token in the vocab");
      t->id_to_bytes_[id] = content;
      (normalized && t->nfc_ ? t->added_normalized_ : t->added_raw_).push_back({content, static_cast<int32_t>(id), normalized});
    }
  }
  for (const char* eot : {"<|endoftext|>", "<|end_of_text|>"})
    if (auto id = t->added_token_id(eot)) t->eot_ = *id;

  // post_processor: the special tokens around a single text
  std::vector<nlohmann::json> processors;
  if (auto p = j.find("post_processor"); p != j.end() && !p->is_null()) {
    if (type_of(*p) == "Sequence") {
      for (const auto& q : p->value("processors", nlohmann::json::array())) processors.push_back(q);
    } else {
      processors.push_back(*p);
    }
  }
  for (const auto& p : processors) {
    if (type_of(p) == "ByteLevel") continue;  // offsets only
    if (type_of(p) != "TemplateProcessing")
      refuse(file, "post_processor", "'" + type_of(p) + "' is not implemented (ByteLevel, TemplateProcessing are)");
    bool seen_text = false;
    for (const auto& item : p.value("single", nlohmann::json::array())) {
      if (item.contains("Sequence")) {
        seen_text = true;
      } else if (item.contains("SpecialToken")) {
        const std::string name = item["SpecialToken"].value("id", "");
        const auto& st = p.value("special_tokens", nlohmann::json::object());
        if (!st.contains(name) || !st[name].contains("ids") || st[name]["ids"].size() != 1)
          refuse(file, "post_processor.special_tokens", "'" + name + "' is not there with one id");
        (seen_text ? t->after_ : t->before_).push_back(st[name]["ids"][0].get<int32_t>());
      }
    }
  }
  for (int32_t id : t->before_) t->token_bytes(id);  // an id outside the vocab: an error now
  for (int32_t id : t->after_) t->token_bytes(id);
  return t;
}

}  // namespace flowrun
