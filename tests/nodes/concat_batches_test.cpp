// concat_batches: several batches as one, rows in the order listed (each key concatenated along
// the batch dimension), captions likewise; batches of other keys or shapes are an error naming
// the inputs. The LoRA demo's prior preservation uses it (graphs/hydit_lora.yaml, tested by
// GraphHyditLora.*).
#include <gtest/gtest.h>

#include <mutex>

#include "data/synthetic_regression.hpp"
#include "node_test_helpers.hpp"

namespace flowrun {
namespace {

// Two sources of 3 and 2 rows a step, their batches and captions concatenated.
const char* kTwoSources = R"(
flowrun: 1
run: { steps: 3, seed: 5 }
nodes:
  a:    { type: synthetic_regression, with: { in_dim: 4, out_dim: 2, batch: 3 } }
  b:    { type: synthetic_regression, with: { in_dim: 4, out_dim: 2, batch: 2, seed: 9 } }
  mix:  { type: concat_batches, in: { batches: [a.batch, b.batch] } }
  probe: { type: t_batch_probe, in: { batch: mix.batch } }
)";

TEST(ConcatBatches, RowsOfEachBatchInTheOrderListed) {
  auto g = test::load_graph_text(kTwoSources);
  const auto seen = test::run_and_probe(*g);
  ASSERT_EQ(seen.size(), 3u);
  // What each source draws at a step by itself (a data node's batch of step s is a function of
  // its seed and s): the first's 3 rows, then the second's 2.
  SyntheticRegression a(4, 2, 32, /*seed=*/5, 0.0), b(4, 2, 32, /*seed=*/9, 0.0);
  for (int64_t step = 1; step <= 3; ++step) {
    const TensorMap want_a = a.batch(step, 3), want_b = b.batch(step, 2);
    for (const char* key : {"x", "y"}) {
      const torch::Tensor& got = seen.at(step).at(key);
      ASSERT_EQ(got.size(0), 5) << key;
      EXPECT_TRUE(torch::equal(got.narrow(0, 0, 3), want_a.at(key))) << key << " at step " << step;
      EXPECT_TRUE(torch::equal(got.narrow(0, 3, 2), want_b.at(key))) << key << " at step " << step;
    }
  }
}

// Remembers the captions it reads, by step.
struct TextProbe : Node {
  static std::map<int64_t, std::vector<std::string>>& seen() {
    static std::map<int64_t, std::vector<std::string>> s;
    return s;
  }
  void run(StepContext& c) override { seen()[c.step()] = c.in<std::vector<std::string>>("text"); }
};

// Captions follow their rows.
TEST(ConcatBatches, CaptionsFollowTheirRows) {
  static std::once_flag once;
  std::call_once(once, [] {
    Registry::global().add(R"(type: t_text_probe
doc: remembers the captions it reads
inputs: { text: { kind: value, type: text, doc: captions } })",
                           [] { return std::make_unique<TextProbe>(); }, "tests");
  });
  auto g = test::load_graph_text(R"(
flowrun: 1
run: { steps: 2 }
nodes:
  a:    { type: synthetic_regression, with: { in_dim: 4, batch: 2 } }
  ta:   { type: t_captions, with: { captions: ["a1 {step}", "a2 {step}"] } }
  b:    { type: synthetic_regression, with: { in_dim: 4, batch: 1, seed: 3 } }
  tb:   { type: t_captions, with: { captions: ["b1 {step}"] } }
  mix:  { type: concat_batches, in: { batches: [a.batch, b.batch], captions: [ta.text, tb.text] } }
  probe: { type: t_text_probe, in: { text: mix.captions } }
)");
  g->run();
  EXPECT_EQ(TextProbe::seen().at(1), (std::vector<std::string>{"a1 1", "a2 1", "b1 1"}));
  EXPECT_EQ(TextProbe::seen().at(2), (std::vector<std::string>{"a1 2", "a2 2", "b1 2"}));
}

TEST(ConcatBatches, BatchesOfOtherKeysOrShapesAreAnErrorNamingThem) {
  auto run_error = [](const std::string& b) {
    try {
      auto g = test::load_graph_text(std::string(R"(
flowrun: 1
run: { steps: 1 }
nodes:
  a:    { type: synthetic_regression, with: { in_dim: 4, batch: 2 } }
  b:    { type: synthetic_regression, with: )") + b + R"( }
  mix:  { type: concat_batches, in: { batches: [a.batch, b.batch] } }
  probe: { type: t_batch_probe, in: { batch: mix.batch } }
)");
      g->run();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string shapes = run_error("{ in_dim: 5, batch: 2 }");
  EXPECT_NE(shapes.find("mix"), std::string::npos) << shapes;
  EXPECT_NE(shapes.find("key 'x' is [2, 4] Float in a.batch but [2, 5] Float in b.batch"), std::string::npos) << shapes;
  EXPECT_EQ(run_error("{ in_dim: 4, batch: 7 }"), "no error");  // other row counts are the point
}

}  // namespace
}  // namespace flowrun
