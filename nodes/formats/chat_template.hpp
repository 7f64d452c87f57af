// Chat templates: a conversation as the text a chat model was trained on, and which bytes of it
// are the assistant's (what supervised fine-tuning trains on). Torch-free (`flowrun prep chat`).
//
//   auto tmpl = ChatTemplate::from_folder("models/qwen3");   // its tokenizer_config.json's chat_template
//   ChatRender r = tmpl->render({{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello."}}, {});
//   // r.text: "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n
//   //          <think>\n\n</think>\n\nHello.<|im_end|>\n";  r.assistant: the byte range from "<think>" to the end
//
// Hugging Face keeps a model's template as Jinja text (tokenizer_config.json's "chat_template", or
// chat_template.jinja beside it); flowrun has no Jinja engine. Instead each template it knows is
// written out here as code, and a folder's template is recognised by its exact text (FNV-1a 64 of
// the bytes, as TRL recognises templates by comparing them whole): a template not in the table is
// refused, naming its hash, rather than rendered otherwise than the model was trained.
//
// Known (docs/data.md has the table and how to add one):
//   llama3      Llama 3 / 3.0: <|begin_of_text|>, then <|start_header_id|>ROLE<|end_header_id|>\n\n
//               CONTENT|trim<|eot_id|> per message (TRL's llama3.jinja and llama3_training.jinja)
//   llama3.1    Llama 3.1 and 3.2: the same after a system block that always comes, with
//   llama3.2    "Cutting Knowledge Date: December 2023\nToday Date: DATE\n\n" before the system
//               message (3.1: DATE "26 Jul 2024"; 3.2: today, as transformers' strftime_now)
//   qwen2.5     ChatML, with Qwen 2.5's default system message when the conversation has none
//   qwen2.5-training  TRL's qwen2_5_training.jinja: "\n" before an empty assistant content too
//   qwen3       ChatML with Qwen 3's reasoning: an assistant turn after the last user message gets
//               <think>\nREASONING\n</think>\n\n before its content (an empty block when it has no
//               reasoning and is the last message); reasoning of turns before the last user
//               message is dropped (so a longer conversation does not render as a prefix of it)
//   qwen3-training  TRL's qwen3_training.jinja: every assistant turn gets its <think> block
//
// The assistant ranges are what TRL's training templates mark with {% generation %}: Llama 3's
// CONTENT|trim<|eot_id|>; Qwen 2.5's "\n" CONTENT <|im_end|>\n; Qwen 3's <think>... CONTENT
// <|im_end|>\n. Tool calls and tool messages are not rendered (refused by the caller).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace flowrun {

struct ChatMessage {
  std::string role;                      // system, user, assistant
  std::string content;
  std::optional<std::string> reasoning;  // an assistant's reasoning_content (Qwen 3); else taken from <think>...</think> in content
};

struct ChatOptions {
  bool add_generation_prompt = false;  // end with the assistant's header (generation)
  bool enable_thinking = true;         // qwen3: false adds an empty <think> block to the generation prompt
  std::string date;                    // llama3.2's "Today Date"; empty: today ("07 Dec 2026")
};

struct ChatRender {
  std::string text;
  std::vector<std::pair<size_t, size_t>> assistant;  // byte ranges [begin, end) of text
};

class ChatTemplate {
 public:
  virtual ~ChatTemplate() = default;
  virtual std::string name() const = 0;
  // Throws std::invalid_argument for a conversation the template cannot render (a role it does
  // not know), naming the message.
  virtual ChatRender render(const std::vector<ChatMessage>& messages, const ChatOptions& options) const = 0;

  // By name (the list above); throws std::invalid_argument naming the known ones.
  static std::unique_ptr<ChatTemplate> named(const std::string& name);
  // The template whose Jinja text this is; throws std::invalid_argument naming `where`, the hash
  // and the known templates when it is none of them.
  static std::unique_ptr<ChatTemplate> recognise(const std::string& jinja, const std::string& where);
  // A model folder's: chat_template.jinja, else tokenizer_config.json's "chat_template".
  static std::unique_ptr<ChatTemplate> from_folder(const std::string& folder);
  static std::vector<std::string> known();
};

// FNV-1a 64 of a template's text, as the table and the refusal write it ("%016x").
std::string chat_template_hash(const std::string& jinja);

class BpeTokenizer;

// A conversation as a model reads it: the messages' text normalized as the tokenizer normalizes
// (NFC for Qwen; so the rendered text is what it tokenizes, byte for byte), rendered, tokenized,
// and per id 1 when it is (in part) assistant output: the token holding a range's first byte
// through the one holding its last, as transformers' return_assistant_tokens_mask marks them.
struct ChatTokens {
  std::string text;
  std::vector<int32_t> ids;
  std::vector<uint8_t> assistant;
};
ChatTokens tokenize_chat(const ChatTemplate& tmpl, const BpeTokenizer& tokenizer, std::vector<ChatMessage> messages,
                         const ChatOptions& options);

}  // namespace flowrun
