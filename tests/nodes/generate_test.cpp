// Generation with a KV cache: greedy decoding of three small models that transformers made (a
// Llama, a Qwen 3 and a GPT-2, tests/fixtures/hf/make_generate_fixture.py) gives transformers' generate()
// ids, up to 64 new tokens or the end-of-text id, for a left-padded batch of three prompts and for each prompt alone, with the
// cache and without; sampling is reproducible from its seed; the cache is faster.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>

#include "models/generate.hpp"
#include "data_test_helpers.hpp"
#include "support/run_graph.hpp"

namespace flowrun {
namespace generate_test {

const std::string kDir = std::string(FLOWRUN_SOURCE_DIR) + "/tests/fixtures/hf/generate";

const nlohmann::json& fixture() {
  static const nlohmann::json j = nlohmann::json::parse(std::ifstream(kDir + "/generate.json"));
  return j;
}

std::unique_ptr<test::GraphRun> model_of(const std::string& name) {
  return test::load_graph_text("flowrun: 1\nrun: { steps: 1 }\nnodes:\n  model: { type: " + std::string(name == "gpt2" ? "gpt" : "llama") +
                               ", with: { pretrained: " + kDir + "/" + name + " } }\n");
}

class Generate : public ::testing::TestWithParam<std::string> {};

TEST_P(Generate, GreedyIsTransformersGenerateWithAndWithoutTheCache) {
  const auto g = model_of(GetParam());
  ModelState& m = g->state<ModelState>("model", "params");
  const nlohmann::json& want = fixture()["models"][GetParam()];
  const auto prompts = want["prompts"].get<std::vector<std::vector<int64_t>>>();
  GenerateOptions o;
  o.max_new_tokens = 64, o.stop_ids = {2};  // the fixtures' end-of-text id
  const GenerateResult cached = generate(m, prompts, o);
  o.use_cache = false;
  const GenerateResult recomputed = generate(m, prompts, o);
  EXPECT_EQ(cached.tokens, want["greedy"].get<std::vector<std::vector<int64_t>>>());
  EXPECT_EQ(recomputed.tokens, cached.tokens);
  o.use_cache = true;
  for (size_t i = 0; i < prompts.size(); ++i)
    EXPECT_EQ(generate(m, {prompts[i]}, o).tokens[0], want["single"][i].get<std::vector<int64_t>>()) << "prompt " << i;
  std::printf("%s: %lld new tokens, %.0f tokens/s with the cache, %.0f without (transformers %s's ids)\n", GetParam().c_str(),
              static_cast<long long>(cached.new_tokens), cached.new_tokens / cached.seconds, recomputed.new_tokens / recomputed.seconds,
              fixture()["transformers"].get<std::string>().c_str());
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Generate, ::testing::Values("llama", "qwen3", "gpt2"));

TEST(Generate, SamplingIsReproducibleFromItsSeedAndStopsWhereAsked) {
  const auto g = model_of("qwen3");
  ModelState& m = g->state<ModelState>("model", "params");
  GenerateOptions o;
  o.max_new_tokens = 32, o.temperature = 0.8, o.top_k = 50, o.top_p = 0.9, o.seed = 5;
  const std::vector<std::vector<int64_t>> prompts = {{5, 6, 7}, {8}};
  const GenerateResult a = generate(m, prompts, o), b = generate(m, prompts, o);
  EXPECT_EQ(a.tokens, b.tokens);
  o.seed = 6;
  EXPECT_NE(generate(m, prompts, o).tokens, a.tokens);
  // a stop id ends its row (it is the last id), the other rows go on
  o.seed = 5, o.stop_ids = {a.tokens[0][3]};
  const GenerateResult s = generate(m, prompts, o);
  ASSERT_LE(s.tokens[0].size(), 4u);
  EXPECT_EQ(s.tokens[0].back(), a.tokens[0][3]);
  // a caller's stop (stop strings): after 5 ids
  o.stop_ids.clear();
  const GenerateResult five = generate(m, prompts, o, [](size_t, const std::vector<int64_t>& ids) { return ids.size() >= 5; });
  EXPECT_EQ(five.tokens[0].size(), 5u);
  EXPECT_EQ(five.tokens[1].size(), 5u);
  // too long for the model's positions, and an empty prompt, are refused
  o.max_new_tokens = 1000;
  EXPECT_THROW(generate(m, prompts, o), std::invalid_argument);
  o.max_new_tokens = 4;
  EXPECT_THROW(generate(m, {{}}, o), std::invalid_argument);
}

// The generate node in a graph: Qwen 3's tokenizer and chat template around a (random, tiny)
// model of its vocabulary; the completions of each prompt written to the run's folder, the rate
// logged as a metric.
TEST(GenerateNode, WritesEachPromptsCompletionToTheRunsFolder) {
  const std::string qwen3 = test::data_dir() + "/tokenizers/qwen3";
  FLOWRUN_NEEDS_DATA(qwen3 + "/tokenizer.json");
  const test::RunResult r = test::run_graph_text(R"(flowrun: 1
run: { steps: 2 }
nodes:
  model: { type: llama, with: { layers: 1, dim: 16, heads: 2, kv_heads: 1, mlp_dim: 32, vocab: 151669, context: 128 } }
  gen:   { type: generate, every: 2, in: { model: model.params },
           with: { tokenizer: )" + qwen3 + R"(, prompts: ["What is a fortune?", "Say <b>hi</b>."], max_new_tokens: 6,
                   system: "Be brief.", tensorboard: true } }
  log:   { type: metrics, every: 2, in: { tokens_per_s: gen.tokens_per_s } }
)");
  const auto lines = test::read_jsonl(r.out_dir + "/generations.jsonl");
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["step"], 2);
  EXPECT_EQ(lines[1]["prompt"], "Say <b>hi</b>.");
  EXPECT_TRUE(lines[0]["completion"].is_string());
  const std::string page = test::read_text(r.out_dir + "/generations/step_0000002.html");
  EXPECT_NE(page.find("Say &lt;b&gt;hi&lt;/b&gt;."), std::string::npos);
  ASSERT_FALSE(r.metrics.empty());
  EXPECT_GT(r.metrics.back()["tokens_per_s"].get<double>(), 0.0);
  // TensorBoard text, read back by the independent reader: a Markdown table of both
  const std::string events = r.dir + "/events.jsonl";
  ASSERT_EQ(std::system(("python3 " + std::string(FLOWRUN_SOURCE_DIR) + "/tests/tools/read_tfevents.py " + r.out_dir + "/tb > " +
                         events).c_str()),
            0);
  bool found = false;
  for (const auto& e : test::read_jsonl(events))
    if (e["texts"].contains("gen")) {
      const std::string md = e["texts"]["gen"].get<std::string>();
      found = e["step"] == 2 && md.rfind("| prompt | completion |", 0) == 0 && md.find("| Say <b>hi</b>. |") != std::string::npos;
    }
  EXPECT_TRUE(found) << test::read_text(events);
}

}  // namespace generate_test
}  // namespace flowrun
