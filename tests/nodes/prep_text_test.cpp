// flowrun prep text: text files -> token shards that read back as the same tokens; the val
// split is a seeded choice of whole documents of the size asked for; bad usage exits 2.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include <set>

#include "formats/indexed_dataset.hpp"
#include "prep/prep.hpp"
#include "prep/prep_text.hpp"
#include "formats/tokenizer.hpp"
#include "data_test_helpers.hpp"
#include "support/run_graph.hpp"

namespace flowrun {
namespace {

std::string as_text(const IndexedDataset& d, int64_t seq) {
  std::string s;
  for (int64_t t : d.sequence(seq)) s.push_back(static_cast<char>(t));
  return s;
}

// A folder of fortune-style files: n documents "doc K\n" separated by "%" lines.
std::string fortune_dir(int n_files, int docs_per_file) {
  const std::string dir = test::temp_dir("prep") + "/in";
  int k = 0;
  for (int f = 0; f < n_files; ++f) {
    std::string text;
    for (int d = 0; d < docs_per_file; ++d) text += "doc " + std::to_string(k++) + "\nsecond line\n%\n";
    test::write_text(dir + "/f" + std::to_string(f), text);
  }
  return dir;
}

TEST(PrepText, OneDocumentPerFileReadsBackTheSameBytes) {
  const std::string dir = test::temp_dir("prep");
  test::write_text(dir + "/in/b.txt", "second file\n");
  test::write_text(dir + "/in/a.txt", "first file, with caf\xc3\xa9\n");
  test::write_text(dir + "/in/sub/c.txt", "third, in a subfolder");
  test::write_text(dir + "/in/.hidden", "never read");
  test::write_text(dir + "/in/empty.txt", "  \n");
  PrepTextOptions o;
  o.tokenizer = "byte", o.val_fraction = 0, o.out = dir + "/out/shards", o.inputs = {dir + "/in"};
  const PrepTextSummary s = prep_text(o);
  EXPECT_EQ(s.files, 4);  // the hidden file is skipped; the blank one is read but holds no document
  EXPECT_EQ(s.documents[0], 3);
  EXPECT_EQ(s.documents[1], 0);

  IndexedDataset train(dir + "/out/shards.train");
  ASSERT_EQ(train.num_documents(), 3);
  EXPECT_EQ(as_text(train, 0), "first file, with caf\xc3\xa9\n");  // sorted by path
  EXPECT_EQ(as_text(train, 1), "second file\n");
  EXPECT_EQ(as_text(train, 2), "third, in a subfolder");
  EXPECT_EQ(IndexedDataset(dir + "/out/shards.val").num_documents(), 0);

  const auto j = nlohmann::json::parse(test::read_text(dir + "/out/shards.json"));
  EXPECT_EQ(j["tokenizer"], "byte");
  EXPECT_EQ(j["vocab_size"], 256);
  EXPECT_EQ(j["documents"], 3);
  EXPECT_EQ(j["tokens"], train.num_tokens());
  EXPECT_EQ(j["dtype"], "uint16");
}

TEST(PrepText, SplitOnSeparatesDocumentsAndValHoldsTheFractionAsked) {
  const std::string in = fortune_dir(4, 25);  // 100 documents
  const std::string out = test::temp_dir("prep");
  PrepTextOptions o;
  o.tokenizer = "byte", o.val_fraction = 0.2, o.seed = 7, o.split_on = "%", o.inputs = {in};
  o.out = out + "/a";
  prep_text(o);
  IndexedDataset train(out + "/a.train"), val(out + "/a.val");
  EXPECT_EQ(train.num_documents(), 80);
  EXPECT_EQ(val.num_documents(), 20);
  // Whole documents, each exactly once in one split; each split keeps input order.
  std::set<std::string> all;
  std::vector<int> val_ids;
  for (const IndexedDataset* d : {&train, &val}) {
    int prev = -1;
    for (int64_t i = 0; i < d->num_sequences(); ++i) {
      const std::string doc = as_text(*d, i);
      const int k = std::stoi(doc.substr(4));
      EXPECT_EQ(doc, "doc " + std::to_string(k) + "\nsecond line\n");
      EXPECT_GT(k, prev);
      prev = k;
      all.insert(doc);
      if (d == &val) val_ids.push_back(k);
    }
  }
  EXPECT_EQ(all.size(), 100u);
  // Seeded: the same seed picks the same val documents, another seed others.
  o.out = out + "/b";
  prep_text(o);
  EXPECT_EQ(test::read_text(out + "/b.val.bin"), test::read_text(out + "/a.val.bin"));
  o.out = out + "/c", o.seed = 8;
  prep_text(o);
  EXPECT_NE(test::read_text(out + "/c.val.bin"), test::read_text(out + "/a.val.bin"));
  // A small fraction still holds out one document.
  o.out = out + "/d", o.val_fraction = 0.001;
  prep_text(o);
  EXPECT_EQ(IndexedDataset(out + "/d.val").num_documents(), 1);
}

TEST(PrepText, Gpt2EndsEveryDocumentWithEndOfText) {
  FLOWRUN_NEEDS_DATA(test::gpt2_vocab(), test::gpt2_merges());
  const std::string in = fortune_dir(1, 5), out = test::temp_dir("prep") + "/g";
  PrepTextOptions o;
  o.tokenizer = "gpt2", o.vocab = test::gpt2_vocab(), o.merges = test::gpt2_merges();
  o.val_fraction = 0.2, o.split_on = "%", o.inputs = {in}, o.out = out;
  prep_text(o);
  auto tok = BpeTokenizer::load_gpt2(o.vocab, o.merges);
  IndexedDataset train(out + ".train");
  ASSERT_EQ(train.num_documents(), 4);
  for (int64_t i = 0; i < 4; ++i) {
    std::vector<int64_t> seq = train.sequence(i);
    ASSERT_FALSE(seq.empty());
    EXPECT_EQ(seq.back(), 50256);
    std::vector<int32_t> ids(seq.begin(), seq.end() - 1);
    EXPECT_EQ(tok->decode(ids).substr(0, 4), "doc ");
    EXPECT_EQ(tok->encode(tok->decode(ids)), ids);
  }
  const auto j = nlohmann::json::parse(test::read_text(out + ".json"));
  EXPECT_EQ(j["tokenizer"], "gpt2");
  EXPECT_EQ(j["vocab_size"], 50257);
  EXPECT_EQ(j["eot"], 50256);
  EXPECT_EQ(j["splits"]["val"]["documents"], 1);
}

// A tokenizer.json (here a model folder's): each document is the post-processor's tokens, the
// text's ids, the end-of-text token; ids past 65,500 are int32 (Megatron's rule).
TEST(PrepText, ATokenizerJsonFramesEveryDocumentAsItsModelWas) {
  const std::string llama = test::data_dir() + "/tokenizers/llama3.2", qwen = test::data_dir() + "/tokenizers/qwen3";
  FLOWRUN_NEEDS_DATA(llama + "/tokenizer.json", qwen + "/tokenizer.json");
  const std::string in = fortune_dir(1, 5);
  for (const auto& [folder, bos, eot] : std::vector<std::tuple<std::string, int64_t, int64_t>>{{llama, 128000, 128001},
                                                                                               {qwen, -1, 151643}}) {
    const std::string out = test::temp_dir("prep") + "/h";
    PrepTextOptions o;
    o.tokenizer = folder, o.val_fraction = 0, o.split_on = "%", o.inputs = {in}, o.out = out;
    prep_text(o);
    auto tok = make_tokenizer(folder);
    IndexedDataset train(out + ".train");
    ASSERT_EQ(train.num_documents(), 5);
    for (int64_t i = 0; i < 5; ++i) {
      const std::vector<int64_t> seq = train.sequence(i);
      ASSERT_GE(seq.size(), 3u);
      const size_t first = bos >= 0 ? 1 : 0;
      if (bos >= 0) EXPECT_EQ(seq.front(), bos) << folder;
      EXPECT_EQ(seq.back(), eot) << folder;
      const std::vector<int32_t> ids(seq.begin() + first, seq.end() - 1);
      EXPECT_EQ(tok->decode(ids).substr(0, 4), "doc ");
      EXPECT_EQ(tok->encode(tok->decode(ids)), ids);
    }
    const auto j = nlohmann::json::parse(test::read_text(out + ".json"));
    EXPECT_EQ(j["tokenizer"], "tokenizer.json");
    EXPECT_EQ(j["tokenizer_path"], folder);
    EXPECT_EQ(j["dtype"], "int32");  // Megatron's rule past 65,500
    EXPECT_EQ(j["eot"], eot);
  }
}

TEST(PrepTextCommand, HelpAndSummary) {
  testing::internal::CaptureStdout();
  EXPECT_EQ(prep_command({"text", "--help"}), 0);
  EXPECT_NE(testing::internal::GetCapturedStdout().find("--split-on"), std::string::npos);
  const std::string in = fortune_dir(2, 10), out = test::temp_dir("prep") + "/x";
  testing::internal::CaptureStdout();
  EXPECT_EQ(prep_command({"text", "--tokenizer", "byte", "--split-on=%", "--val-fraction", "0.1", "--out", out, in}), 0);
  const std::string summary = testing::internal::GetCapturedStdout();
  EXPECT_NE(summary.find("20 documents"), std::string::npos) << summary;
  EXPECT_NE(summary.find(out + ".train.{bin,idx}: 18 documents"), std::string::npos) << summary;
  EXPECT_NE(summary.find(out + ".val.{bin,idx}: 2 documents"), std::string::npos) << summary;
}

TEST(PrepTextCommand, BadUsageAndMissingInputsExit2) {
  const std::string dir = test::temp_dir("prep");
  test::write_text(dir + "/a.txt", "some text\n");
  test::write_text(dir + "/b.txt", "more text\n");
  const std::string out = dir + "/out";
  auto code = [](std::vector<std::string> args) {
    testing::internal::CaptureStderr();
    const int c = prep_command(args);
    const std::string err = testing::internal::GetCapturedStderr();
    return std::make_pair(c, err);
  };
  const std::string a = dir + "/a.txt", b = dir + "/b.txt";
  std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{}, "usage: flowrun prep"},
      {{"video"}, "unknown kind 'video'"},
      {{"text", "--out", out, a}, "--tokenizer byte|gpt2|TOKENIZER_JSON|MODEL_FOLDER is required"},
      {{"text", "--tokenizer", "bpe", "--out", out, a}, "unknown tokenizer 'bpe'"},
      {{"text", "--tokenizer", "gpt2", "--out", out, a}, "needs --vocab"},
      {{"text", "--tokenizer", "gpt2", "--vocab", dir + "/no.json", "--merges", dir + "/no.txt", "--out", out, a, b},
       dir + "/no.json: cannot open"},
      {{"text", "--tokenizer", "byte", "--out", out, dir + "/missing.txt"}, dir + "/missing.txt: no such file"},
      {{"text", "--tokenizer", "byte", a, b}, "--out PREFIX is required"},
      {{"text", "--tokenizer", "byte", "--out", out}, "no input files"},
      {{"text", "--tokenizer", "byte", "--val-fraction", "1.5", "--out", out, a, b}, "--val-fraction must be in [0, 1)"},
      {{"text", "--tokenizer", "byte", "--val-fraction", "abc", "--out", out, a, b}, "'abc' is not a number"},
      {{"text", "--tokenizer", "byte", "--seed", "-1", "--out", out, a, b}, "not a non-negative integer"},
      {{"text", "--tokenizer", "byte", "--frobnicate", "--out", out, a}, "unknown option --frobnicate"},
      {{"text", "--tokenizer", "byte", "--out", out, a}, "only 1 document"},
      {{"text", "--tokenizer", "byte", "--out"}, "--out needs a value"},
      // Issue 47: a 5 GB file ended in a bare std::bad_alloc. Inputs are memory-mapped; one
      // document larger than 1 GiB is refused (here a sparse file: nothing is written to disk).
      {{"text", "--tokenizer", "byte", "--val-fraction", "0", "--out", out, dir + "/huge.txt"},
       dir + "/huge.txt: 1025 MiB as one document (no --split-on)"},
      {{"text", "--tokenizer", "byte", "--val-fraction", "0", "--split-on", "%", "--out", out, dir + "/huge.txt"},
       dir + "/huge.txt: a document of 1025 MiB (document 1)"},
  };
  {
    std::ofstream(dir + "/huge.txt") << "x";
    std::filesystem::resize_file(dir + "/huge.txt", (uint64_t{1025} << 20));
  }
  for (const auto& [args, want] : cases) {
    auto [c, err] = code(args);
    EXPECT_EQ(c, 2) << testing::PrintToString(args);
    EXPECT_NE(err.find(want), std::string::npos) << testing::PrintToString(args) << "\n" << err;
  }
  EXPECT_FALSE(std::filesystem::exists(out + ".train.bin"));
}

}  // namespace
}  // namespace flowrun
