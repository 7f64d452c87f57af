// Chat templates: 200 conversations rendered and tokenized as transformers' apply_chat_template
// does with each template's own Jinja text (tests/fixtures/tokenizers/make_chat_fixture.py,
// transformers 5.17.0: Llama 3, 3.1, 3.2, Qwen 2.5 and two Qwen 3 revisions as released, TRL's
// training variants), the assistant mask as its return_assistant_tokens_mask gives it; then the
// Qwen 3 traps spelled out, and a template flowrun does not know refused. Needs the released
// tokenizers of scripts/data.sh (data/tokenizers/); without them skipped.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <map>

#include "formats/chat_template.hpp"
#include "formats/tokenizer.hpp"
#include "nodes/data_test_helpers.hpp"
#include "support/id_hash.hpp"
#include "support/run_graph.hpp"

namespace flowrun {
namespace chat_template_test {

std::string folder(const std::string& family) { return test::data_dir() + "/tokenizers/" + family; }

const BpeTokenizer& tokenizer(const std::string& family) {
  static std::map<std::string, std::unique_ptr<BpeTokenizer>> loaded;
  auto& t = loaded[family];
  if (!t) t = BpeTokenizer::load_hf(folder(family) + "/tokenizer.json");
  return *t;
}

const nlohmann::json& fixture() {
  static const nlohmann::json j = [] {
    std::ifstream in(std::string(FLOWRUN_SOURCE_DIR) + "/tests/fixtures/tokenizers/chat.json");
    return nlohmann::json::parse(in);
  }();
  return j;
}

std::vector<ChatMessage> messages_of(const nlohmann::json& conv) {
  std::vector<ChatMessage> out;
  for (const auto& m : conv["messages"]) {
    ChatMessage msg{m["role"].get<std::string>(), m["content"].get<std::string>(), std::nullopt};
    if (m.contains("reasoning_content")) msg.reasoning = m["reasoning_content"].get<std::string>();
    out.push_back(std::move(msg));
  }
  return out;
}

std::vector<std::array<int64_t, 2>> runs(const std::vector<uint8_t>& mask) {
  std::vector<std::array<int64_t, 2>> out;
  for (size_t i = 0; i < mask.size(); ++i)
    if (mask[i] && (i == 0 || !mask[i - 1])) out.push_back({static_cast<int64_t>(i), static_cast<int64_t>(i) + 1});
    else if (mask[i]) out.back()[1] = static_cast<int64_t>(i) + 1;
  return out;
}

// Every template of the fixture is recognised from its text, renders each conversation to
// transformers' ids, and where transformers marks the assistant's tokens (the training
// templates), flowrun marks the same ones; a stock template's mask equals its training twin's
// wherever the two render the same ids.
TEST(ChatTemplate, RendersAndMasksAsTransformersApplyChatTemplate) {
  FLOWRUN_NEEDS_DATA(folder("llama3.2") + "/tokenizer.json", folder("qwen3") + "/tokenizer.json");
  const nlohmann::json& fx = fixture();
  ChatOptions opt;
  opt.date = fx["date_string"].get<std::string>();
  const std::map<std::string, std::string> twin = {{"llama3", "llama3_training"}, {"qwen2_5", "qwen2_5_training"},
                                                   {"qwen3", "qwen3_training"}, {"qwen3_packaged", "qwen3_training"}};
  int compared = 0, masks = 0, wrong = 0;
  for (const auto& [name, t] : fx["templates"].items()) {
    const auto tmpl = ChatTemplate::recognise(t["template"].get<std::string>(), name);
    const BpeTokenizer& tok = tokenizer(t["family"].get<std::string>());
    const bool training = name.find("training") != std::string::npos;
    for (size_t i = 0; i < fx["conversations"].size(); ++i) {
      const auto& conv = fx["conversations"][i];
      opt.add_generation_prompt = conv["add_generation_prompt"].get<bool>();
      const ChatTokens got = tokenize_chat(*tmpl, tok, messages_of(conv), opt);
      const auto& want = t["results"][i];
      ++compared;
      if ((static_cast<int64_t>(got.ids.size()) != want["n"].get<int64_t>() || test::ids_fnv32(got.ids) != want["hash"].get<std::string>()) &&
          wrong++ < 5) {
        ADD_FAILURE() << name << " (" << tmpl->name() << "), conversation " << i << ": " << got.ids.size() << " ids, transformers "
                      << want["n"] << "\n" << nlohmann::json(got.text).dump()
                      << (want.contains("ids") ? "\n  flowrun:      " + nlohmann::json(got.ids).dump() +
                                                     "\n  transformers: " + want["ids"].dump()
                                               : std::string());
        continue;
      }
      std::optional<nlohmann::json> mask_ref;
      if (training) mask_ref = want["mask"];
      if (twin.count(name)) {
        const auto& other = fx["templates"][twin.at(name)]["results"][i];
        if (other["n"] == want["n"] && other["hash"] == want["hash"]) mask_ref = other["mask"];
      }
      if (!mask_ref) continue;
      ++masks;
      const auto mine = runs(got.assistant);
      if (nlohmann::json(mine) != *mask_ref && wrong++ < 5)
        ADD_FAILURE() << name << ", conversation " << i << ": assistant tokens " << nlohmann::json(mine).dump()
                      << ", transformers " << mask_ref->dump() << "\n" << nlohmann::json(got.text).dump();
    }
  }
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(compared, 9 * 200);
  EXPECT_GT(masks, 4 * 200);
  std::printf("%d renderings equal to transformers %s, %d assistant masks\n", compared,
              fx["transformers"].get<std::string>().c_str(), masks);
}

// Qwen 3's template, spelled out: the empty think block on the last assistant turn, reasoning
// kept after the last user message and dropped before it, so a conversation does not render as
// the prefix of its continuation.
TEST(ChatTemplate, Qwen3KeepsReasoningOnlyAfterTheLastQuestion) {
  const auto q = ChatTemplate::named("qwen3");
  const ChatRender one = q->render({{"user", "Hi", {}}, {"assistant", "Hello.", {}}}, {});
  EXPECT_EQ(one.text, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello.<|im_end|>\n");
  ASSERT_EQ(one.assistant.size(), 1u);
  EXPECT_EQ(one.text.substr(one.assistant[0].first), "<think>\n\n</think>\n\nHello.<|im_end|>\n");

  const ChatRender two = q->render({{"user", "Hi", {}},
                                    {"assistant", "<think>\nGreet back.\n</think>\n\nHello.", {}},
                                    {"user", "2+2?", {}},
                                    {"assistant", "4", std::string("Add.")}},
                                   {});
  EXPECT_EQ(two.text,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"  // reasoning dropped
            "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nAdd.\n</think>\n\n4<|im_end|>\n");
  EXPECT_NE(two.text.rfind(one.text.substr(0, 40), 0), std::string::npos);
  EXPECT_EQ(two.text.find("Greet back"), std::string::npos);

  ChatOptions no_think;
  no_think.add_generation_prompt = true, no_think.enable_thinking = false;
  EXPECT_EQ(q->render({{"user", "Hi", {}}}, no_think).text,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  // TRL's training variant keeps every turn's block
  EXPECT_NE(ChatTemplate::named("qwen3-training")
                ->render({{"user", "Hi", {}}, {"assistant", "<think>\nGreet back.\n</think>\n\nHello.", {}}, {"user", "x", {}}}, {})
                .text.find("Greet back"),
            std::string::npos);
}

TEST(ChatTemplate, Llama3TrimsAndLlama32DatesTheSystemBlock) {
  ChatOptions o;
  o.date = "07 Dec 2026";
  EXPECT_EQ(ChatTemplate::named("llama3")->render({{"user", "  Hi \n", {}}, {"assistant", "Hello", {}}}, o).text,
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>");
  EXPECT_EQ(ChatTemplate::named("llama3.2")->render({{"system", " Be brief. ", {}}, {"user", "Hi", {}}}, o).text,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
            "Today Date: 07 Dec 2026\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>");
  // |trim is Python's str.strip(): Unicode spaces too (U+3000, U+00A0), not U+200B
  EXPECT_EQ(ChatTemplate::named("llama3")->render({{"user", "\xe3\x80\x80" "a\xc2\xa0\xe2\x80\x8b", {}}}, o).text,
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\na\xc2\xa0\xe2\x80\x8b<|eot_id|>");
  EXPECT_THROW(ChatTemplate::named("llama3")->render({{"tool", "{}", {}}}, o), std::invalid_argument);
}

TEST(ChatTemplate, AnUnknownTemplateIsRefusedNamingItsHash) {
  try {
    ChatTemplate::recognise("{% for m in messages %}{{ m.content }}{% endfor %}", "models/x/tokenizer_config.json");
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("models/x/tokenizer_config.json"), std::string::npos) << w;
    EXPECT_NE(w.find(chat_template_hash("{% for m in messages %}{{ m.content }}{% endfor %}")), std::string::npos) << w;
    EXPECT_NE(w.find("qwen3"), std::string::npos) << w;
  }
  EXPECT_THROW(ChatTemplate::named("mistral"), std::invalid_argument);
  // the Qwen 3 folder of scripts/data.sh: its tokenizer_config.json's template is recognised
  if (std::filesystem::exists(folder("qwen3") + "/tokenizer_config.json"))
    EXPECT_EQ(ChatTemplate::from_folder(folder("qwen3"))->name(), "qwen3");
}

}  // namespace chat_template_test
}  // namespace flowrun
