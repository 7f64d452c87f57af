// flowrun prep chat: every line format becomes the conversation it says; the shards read back as
// the template's ids with the assistant mask; bad lines are counted by reason and skipped, or
// stop the prep with --strict, leaving what was there before untouched. Needs the Qwen 3 folder
// of scripts/data.sh (data/tokenizers/qwen3: tokenizer.json and its chat template).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>

#include "data_test_helpers.hpp"
#include "formats/indexed_dataset.hpp"
#include "formats/tokenizer.hpp"
#include "prep/prep.hpp"
#include "prep/prep_chat.hpp"
#include "support/run_graph.hpp"

namespace flowrun {
namespace prep_chat_test {

std::string qwen3() { return test::data_dir() + "/tokenizers/qwen3"; }

std::vector<std::pair<std::string, std::string>> roles(const std::string& line) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const ChatMessage& m : chat_messages_from_json(nlohmann::json::parse(line))) out.emplace_back(m.role, m.content);
  return out;
}

using Conv = std::vector<std::pair<std::string, std::string>>;

TEST(PrepChat, EveryLineFormatIsTheConversationItSays) {
  EXPECT_EQ(roles(R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                                   {"role": "assistant", "content": "A"}]})"),
            (Conv{{"system", "S"}, {"user", "Q"}, {"assistant", "A"}}));
  EXPECT_EQ(roles(R"({"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]})"),
            (Conv{{"user", "Q"}, {"assistant", "A"}}));
  EXPECT_EQ(roles(R"({"prompt": "Q", "completion": "A"})"), (Conv{{"user", "Q"}, {"assistant", "A"}}));
  EXPECT_EQ(roles(R"({"prompt": [{"role": "user", "content": "Q"}], "completion": [{"role": "assistant", "content": "A"}]})"),
            (Conv{{"user", "Q"}, {"assistant", "A"}}));
  EXPECT_EQ(roles(R"({"instruction": "Translate", "input": "chat", "output": "cat"})"),
            (Conv{{"user", "Translate\n\nchat"}, {"assistant", "cat"}}));
  EXPECT_EQ(roles(R"({"instruction": "Say hi", "input": "", "output": "hi"})"), (Conv{{"user", "Say hi"}, {"assistant", "hi"}}));
  const auto reasoning = chat_messages_from_json(nlohmann::json::parse(
      R"({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "R"}]})"));
  EXPECT_EQ(reasoning[1].reasoning, "R");
  for (const char* bad : {R"({"messages": [{"role": "bot", "content": "x"}]})", R"({"messages": []})", R"({"text": "x"})",
                          R"({"messages": [{"role": "user", "content": ["a"]}]})", R"({"messages": [{"role": "user"}]})", "[1]"})
    EXPECT_THROW(chat_messages_from_json(nlohmann::json::parse(bad)), std::invalid_argument) << bad;
}

TEST(PrepChat, ShardsHoldTheTemplatesIdsAndTheAssistantMask) {
  FLOWRUN_NEEDS_DATA(qwen3() + "/tokenizer.json");
  const std::string dir = test::temp_dir("prepchat");
  std::string jsonl;
  for (int i = 0; i < 20; ++i)
    jsonl += R"({"messages": [{"role": "user", "content": "Question )" + std::to_string(i) +
             R"(?"}, {"role": "assistant", "content": "Answer )" + std::to_string(i) + R"(."}]})" + "\n";
  jsonl += "not json\n{\"messages\": [{\"role\": \"user\", \"content\": \"no answer\"}]}\n\n";
  test::write_text(dir + "/data.jsonl", jsonl);
  PrepChatOptions o;
  o.model = qwen3(), o.inputs = {dir + "/data.jsonl"}, o.out = dir + "/chat", o.val_fraction = 0.1;
  const PrepChatSummary s = prep_chat(o);
  EXPECT_EQ(s.lines, 22);
  EXPECT_EQ(s.documents[0] + s.documents[1], 20);
  EXPECT_EQ(s.skipped, (std::map<std::string, int64_t>{{"not JSON", 1}, {"nothing to train on", 1}}));
  EXPECT_EQ(s.template_name, "qwen3");

  // Each conversation: the ids tokenize_chat gives, the mask on the assistant's part only
  const auto tok = BpeTokenizer::load_hf(qwen3() + "/tokenizer.json");
  const auto tmpl = ChatTemplate::from_folder(qwen3());
  IndexedDataset ids(dir + "/chat.train"), mask(dir + "/chat.train.mask");
  ASSERT_EQ(ids.num_documents(), mask.num_documents());
  int found = 0;
  for (int64_t d = 0; d < ids.num_documents(); ++d) {
    const std::vector<int64_t> seq = ids.sequence(d), m = mask.sequence(d);
    ASSERT_EQ(seq.size(), m.size());
    std::string text;
    std::string trained;
    for (size_t i = 0; i < seq.size(); ++i) {
      text += tok->token_bytes(static_cast<int32_t>(seq[i]));
      if (m[i]) trained += tok->token_bytes(static_cast<int32_t>(seq[i]));
    }
    const size_t q = text.find("Question ");
    ASSERT_NE(q, std::string::npos) << text;
    const std::string n = text.substr(q + 9, text.find('?') - q - 9);
    EXPECT_EQ(text, "<|im_start|>user\nQuestion " + n + "?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nAnswer " + n +
                        ".<|im_end|>\n");
    EXPECT_EQ(trained, "<think>\n\n</think>\n\nAnswer " + n + ".<|im_end|>\n");
    ++found;
  }
  EXPECT_EQ(found, 18);
  const auto j = nlohmann::json::parse(test::read_text(dir + "/chat.json"));
  EXPECT_EQ(j["kind"], "chat");
  EXPECT_EQ(j["template"], "qwen3");
  EXPECT_EQ(j["splits"]["val"]["documents"], 2);
  EXPECT_EQ(j["skipped"]["not JSON"], 1);

  // --train-on all: every id; --max-tokens: longer conversations are bad lines
  o.train_on_all = true, o.out = dir + "/all", o.val_fraction = 0;
  prep_chat(o);
  for (int64_t v : IndexedDataset(dir + "/all.train.mask").sequence(0)) EXPECT_EQ(v, 1);
  o.train_on_all = false, o.max_tokens = 20, o.out = dir + "/short";
  EXPECT_THROW(prep_chat(o), std::invalid_argument);  // every conversation is longer: nothing left
  EXPECT_FALSE(std::filesystem::exists(dir + "/short.train.bin"));
}

// --strict stops at the first bad line, naming it, and what an earlier prep wrote stays as it was.
TEST(PrepChat, StrictStopsAtTheFirstBadLineAndLeavesEarlierShards) {
  FLOWRUN_NEEDS_DATA(qwen3() + "/tokenizer.json");
  const std::string dir = test::temp_dir("prepchat");
  test::write_text(dir + "/good.jsonl", R"({"prompt": "Q1", "completion": "A1"})" "\n" R"({"prompt": "Q2", "completion": "A2"})" "\n");
  test::write_text(dir + "/bad.jsonl", R"({"prompt": "Q1", "completion": "A1"})" "\n" R"({"messages": [{"role": "bot", "content": "x"}]})" "\n");
  PrepChatOptions o;
  o.model = qwen3(), o.inputs = {dir + "/good.jsonl"}, o.out = dir + "/chat", o.val_fraction = 0;
  prep_chat(o);
  const std::string before = test::read_text(dir + "/chat.train.bin"), json_before = test::read_text(dir + "/chat.json");
  o.inputs = {dir + "/bad.jsonl"}, o.strict = true;
  try {
    prep_chat(o);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(dir + "/bad.jsonl:2: messages[0]: role 'bot'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(test::read_text(dir + "/chat.train.bin"), before);
  EXPECT_EQ(test::read_text(dir + "/chat.json"), json_before);
  EXPECT_FALSE(std::filesystem::exists(dir + "/chat.train.bin.tmp"));

  // the command line: exit 2 and the message; an unknown template is refused by name
  EXPECT_EQ(prep_command({"chat", "--model", qwen3(), "--strict", "--out", dir + "/chat", dir + "/bad.jsonl"}), 2);
  EXPECT_EQ(prep_command({"chat", "--model", qwen3(), "--template", "mistral", "--out", dir + "/chat", dir + "/good.jsonl"}), 2);
  testing::internal::CaptureStdout();
  EXPECT_EQ(prep_command({"chat", "--model", qwen3(), "--val-fraction", "0", "--out", dir + "/c2", dir + "/bad.jsonl"}), 0);
  EXPECT_NE(testing::internal::GetCapturedStdout().find("skipped 1 lines: unknown role 1"), std::string::npos);
}

}  // namespace prep_chat_test
}  // namespace flowrun
