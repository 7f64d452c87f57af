// A Hugging Face tokenizer.json as flowrun's BpeTokenizer: the ids of `tokenizers` itself for the
// released Llama 3.2 and Qwen 3 files (scripts/data.sh puts them in data/tokenizers/; without them
// these tests are skipped), on 16,000 strings: tricky ones, random multilingual ones with emoji,
// control characters and added tokens in them, invalid UTF-8, and every fortune
// (tests/fixtures/tokenizers/make_encode_fixture.py wrote the reference with tokenizers 0.23.3).
// And what is not implemented is refused by name.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <glob.h>

#include "formats/tokenizer.hpp"
#include "formats/utf8.hpp"
#include "nodes/data_test_helpers.hpp"
#include "support/id_hash.hpp"
#include "support/run_graph.hpp"

namespace flowrun {
namespace tokenizer_json_test {

std::string tokenizer_file(const std::string& name) { return test::data_dir() + "/tokenizers/" + name + "/tokenizer.json"; }

const nlohmann::json& fixture() {
  static const nlohmann::json j = [] {
    std::ifstream in(std::string(FLOWRUN_SOURCE_DIR) + "/tests/fixtures/tokenizers/encode.json");
    return nlohmann::json::parse(in);
  }();
  return j;
}

// The fixture's tokenizers: the two files as released, and Llama 3.2's with ignore_merges (as
// Llama 3 and 3.1 ship it), written where the test can load it.
const BpeTokenizer& tokenizer(const std::string& name) {
  static std::map<std::string, std::unique_ptr<BpeTokenizer>> loaded;
  auto& t = loaded[name];
  if (!t) {
    std::string file = tokenizer_file(name == "llama3.2-im" ? "llama3.2" : name);
    if (name == "llama3.2-im") {
      nlohmann::json j = nlohmann::json::parse(test::read_text(file));
      j["model"]["ignore_merges"] = true;
      file = test::temp_dir("tokjson") + "/ignore_merges.json";
      test::write_text(file, j.dump());
    }
    t = BpeTokenizer::load_hf(file);
  }
  return *t;
}

// Every fortune, as the fixture script reads them: the files scripts/data.sh reads, split at
// "\n%\n" (not all_fortunes()' rule: the fixture keeps Python's split), blank ones dropped,
// invalid UTF-8 repaired (encode() does that itself).
std::vector<std::string> fortunes() {
  std::vector<std::string> out;
  for (const std::string& f : test::fortune_files()) {
    const std::string text = test::read_text(f);
    for (size_t start = 0;;) {
      const size_t end = text.find("\n%\n", start);
      std::string t = text.substr(start, end == std::string::npos ? std::string::npos : end - start);
      if (t.find_first_not_of(" \t\n\r\v\f") != std::string::npos) out.push_back(std::move(t));
      if (end == std::string::npos) break;
      start = end + 3;
    }
  }
  return out;
}

std::string unhex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

class TokenizerJson : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerJson, GivesTheIdsOfTheTokenizersLibrary) {
  FLOWRUN_NEEDS_DATA(tokenizer_file("llama3.2"), tokenizer_file("qwen3"));
  const nlohmann::json& fx = fixture();
  const std::string file = GetParam() == "qwen3" ? "qwen3" : "llama3.2";
  // scripts/data.sh checks the files' SHA-256; the size tells another file given by hand
  ASSERT_EQ(static_cast<int64_t>(std::filesystem::file_size(tokenizer_file(file))), fx["file_bytes"][file].get<int64_t>())
      << tokenizer_file(file) << " is not the file the fixture was made with";
  const BpeTokenizer& tok = tokenizer(GetParam());
  const nlohmann::json& want = fx["models"][GetParam()];

  std::vector<int32_t> specials = tok.specials_before();
  specials.insert(specials.end(), tok.specials_after().begin(), tok.specials_after().end());
  EXPECT_EQ(specials, want["specials"].get<std::vector<int32_t>>());

  int compared = 0, wrong = 0;
  auto check = [&](const std::string& text, const std::vector<int32_t>& ref, const std::string& what) {
    const std::vector<int32_t> ids = tok.encode(text);
    ++compared;
    if (ids != ref && wrong++ < 5)
      ADD_FAILURE() << GetParam() << ": " << what << " " << nlohmann::json(repair_utf8(text)).dump() << "\n  flowrun:    "
                    << nlohmann::json(ids).dump() << "\n  tokenizers: " << nlohmann::json(ref).dump();
    // decode gives back the text encode() tokenized: repaired and normalized, byte for byte
    std::string normalized;
    for (int32_t id : ids) normalized += tok.token_bytes(id);
    EXPECT_EQ(tok.decode(ids), normalized);
    EXPECT_EQ(tok.normalize(text), normalized);
  };
  for (size_t i = 0; i < fx["texts"].size(); ++i)
    check(fx["texts"][i].get<std::string>(), want["texts"][i].get<std::vector<int32_t>>(), "text " + std::to_string(i));
  for (size_t i = 0; i < fx["invalid_utf8_hex"].size(); ++i)
    check(unhex(fx["invalid_utf8_hex"][i].get<std::string>()), want["invalid_utf8"][i].get<std::vector<int32_t>>(),
          "invalid UTF-8 " + std::to_string(i));

  const std::vector<std::string> texts = fortunes();
  ASSERT_EQ(static_cast<int64_t>(texts.size()), fx["fortunes"].get<int64_t>()) << "another fortunes package than the fixture's";
  int64_t tokens = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::vector<int32_t> ids = tok.encode(texts[i]);
    const auto& ref = want["fortunes"][i];
    tokens += static_cast<int64_t>(ids.size());
    ++compared;
    if ((static_cast<int64_t>(ids.size()) != ref[0].get<int64_t>() || test::ids_fnv32(ids) != ref[1].get<std::string>()) && wrong++ < 5)
      ADD_FAILURE() << GetParam() << ": fortune " << i << " " << nlohmann::json(repair_utf8(texts[i])).dump() << ": "
                    << ids.size() << " ids, tokenizers " << ref[0];
  }
  EXPECT_EQ(wrong, 0) << wrong << " of " << compared << " texts tokenized otherwise";
  EXPECT_GT(compared, 15000);
  std::printf("%s: %d texts (%lld fortune tokens) equal to tokenizers %s\n", GetParam().c_str(), compared,
              static_cast<long long>(tokens), fx["tokenizers"].get<std::string>().c_str());
}

INSTANTIATE_TEST_SUITE_P(Released, TokenizerJson, ::testing::Values("llama3.2", "llama3.2-im", "qwen3"),
                         [](const auto& info) { return info.param == "llama3.2-im" ? std::string("llama3_2_ignore_merges")
                                                                                   : info.param == "qwen3" ? std::string("qwen3")
                                                                                                           : std::string("llama3_2"); });

// The pieces that make Llama 3's and Qwen's files what they are, spelled out.
TEST(TokenizerJson, AddedTokensSplitTheTextAndTheTemplateAddsBos) {
  FLOWRUN_NEEDS_DATA(tokenizer_file("llama3.2"), tokenizer_file("qwen3"));
  const BpeTokenizer& llama = tokenizer("llama3.2");
  EXPECT_EQ(llama.specials_before(), (std::vector<int32_t>{128000}));  // <|begin_of_text|>
  EXPECT_TRUE(llama.specials_after().empty());
  EXPECT_EQ(llama.eot(), 128001);  // <|end_of_text|>
  EXPECT_EQ(llama.vocab_size(), 128257);  // 128,256 and Llama 3.2 Vision's <|image|>, as tokenizers counts
  EXPECT_EQ(llama.encode("<|eot_id|><|eot_id|>x"), (std::vector<int32_t>{128009, 128009, 87}));
  const BpeTokenizer& qwen = tokenizer("qwen3");
  EXPECT_TRUE(qwen.specials_before().empty());
  EXPECT_EQ(qwen.eot(), 151643);  // <|endoftext|>
  EXPECT_EQ(qwen.added_token_id("<think>"), 151667);
  EXPECT_EQ(qwen.vocab_size(), 151669);
  // NFC: "e" + combining acute is "é", one token with the precomposed one
  EXPECT_EQ(qwen.encode("e\xcc\x81"), qwen.encode("\xc3\xa9"));
  EXPECT_EQ(qwen.normalize("e\xcc\x81"), "\xc3\xa9");
  EXPECT_EQ(qwen.encode("123"), (std::vector<int32_t>{16, 17, 18}));  // one digit at a time
}

// A file that uses a component flowrun does not implement is refused, naming the key and the
// component, rather than tokenizing otherwise than the model was trained.
TEST(TokenizerJson, ComponentsNotImplementedAreRefusedByName) {
  FLOWRUN_NEEDS_DATA(tokenizer_file("qwen3"));
  const nlohmann::json base = nlohmann::json::parse(test::read_text(tokenizer_file("qwen3")));
  const std::string dir = test::temp_dir("tokjson_refused");
  auto error_of = [&](const std::function<void(nlohmann::json&)>& edit) -> std::string {
    nlohmann::json j = base;
    edit(j);
    test::write_text(dir + "/tokenizer.json", j.dump());
    try {
      BpeTokenizer::load_hf(dir + "/tokenizer.json");
    } catch (const std::exception& e) {
      return e.what();
    }
    return "no error";
  };
  auto expect_error = [&](const std::function<void(nlohmann::json&)>& edit, const std::vector<std::string>& parts) {
    const std::string e = error_of(edit);
    EXPECT_NE(e.find(dir + "/tokenizer.json"), std::string::npos) << e;
    for (const std::string& p : parts) EXPECT_NE(e.find(p), std::string::npos) << "'" << p << "' not in: " << e;
  };
  EXPECT_EQ(error_of([](nlohmann::json&) {}), "no error");
  // SentencePiece-style BPE as Llama 2 and Mistral ship it
  expect_error([](nlohmann::json& j) { j["model"]["byte_fallback"] = true; }, {"model", "byte_fallback", "SentencePiece"});
  expect_error([](nlohmann::json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "\u2581"}}; },
               {"pre_tokenizer", "'Metaspace'"});
  expect_error([](nlohmann::json& j) { j["normalizer"] = {{"type", "Lowercase"}}; }, {"normalizer", "'Lowercase'"});
  expect_error([](nlohmann::json& j) { j["model"]["type"] = "WordPiece"; }, {"model", "'WordPiece'"});
  expect_error([](nlohmann::json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\w+"; },
               {"pre_tokenizer.pretokenizers[0].pattern", "Split regex"});
  expect_error([](nlohmann::json& j) { j["added_tokens"][1]["lstrip"] = true; }, {"added_tokens[1]", "lstrip", "<|im_start|>"});
  expect_error([](nlohmann::json& j) { j["post_processor"] = {{"type", "BertProcessing"}}; }, {"post_processor", "'BertProcessing'"});
  expect_error([](nlohmann::json& j) { j["decoder"] = {{"type", "WordPiece"}}; }, {"decoder", "'WordPiece'"});
  expect_error([](nlohmann::json& j) { j["model"]["merges"][7] = "a b c"; }, {"model.merges[7]", "'a b c'"});
  expect_error([](nlohmann::json& j) { j["model"]["merges"][7] = {"\xe6\x97\xa5", "x"}; }, {"model.merges[7]"});
}

// make_tokenizer takes a tokenizer.json or a model folder holding one (prep text's --tokenizer).
TEST(TokenizerJson, TheFactoryTakesAFileOrAFolder) {
  FLOWRUN_NEEDS_DATA(tokenizer_file("qwen3"));
  EXPECT_EQ(make_tokenizer(tokenizer_file("qwen3"))->vocab_size(), 151669);
  EXPECT_EQ(make_tokenizer(test::data_dir() + "/tokenizers/qwen3")->name(), "tokenizer.json");
  try {
    make_tokenizer(test::temp_dir("tokjson_empty"));
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("has no tokenizer.json"), std::string::npos) << e.what();
  }
}

}  // namespace tokenizer_json_test
}  // namespace flowrun
