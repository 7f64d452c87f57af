// graphs/gpt.yaml itself (a real GPT-2 small config), trained at a tiny size chosen by
// overrides — the same file, no separate test graph: a 2-layer, 128-wide, 64-token byte-level
// model on the fortunes corpus for 600 steps (batch 32, lr 3e-3, warmup 50).
//
// Threshold: validation loss below 2.4 nats per byte (the bar; an equivalent PyTorch
// loop reaches about 2.2 in 600 steps). Measured here: 2.07, see the comment at the assertion.
// Needs the byte-level shards from scripts/data.sh (the setup command makes them).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "data_test_helpers.hpp"
#include "support/run_graph.hpp"

using namespace flowrun;

TEST(GraphGpt, TinyConfigLearnsFortunesBelow2p4NatsPerByte) {
  const std::string src = FLOWRUN_SOURCE_DIR;
  const std::string shards = src + "/data/text/fortunes_byte";
  FLOWRUN_NEEDS_DATA(shards + ".train.bin");
  std::ifstream in(src + "/graphs/gpt.yaml");
  std::stringstream text;
  text << in.rdbuf();
  auto r = test::run_graph_text(
      text.str(), {"data.path=" + shards, "data.seq_len=64", "data.batch=32", "model.layers=2", "model.dim=128",
                   "model.heads=4", "model.vocab=256", "model.context=64", "opt.lr=3e-3", "opt.warmup=50",
                   "opt.min_lr=3e-4", "run.steps=600", "run.log_every=50", "run.prefetch=2",
                   // evaluate the trained weights themselves at the end, on 50 val batches
                   "eval.in.model=model.params", "eval.every=600", "evlog.every=600", "eval.batches=50",
                   "eval.batch=32", "ckpt.every=600"});
  double first_loss = -1, val_loss = -1;
  for (const auto& j : r.metrics) {
    if (j.contains("loss") && first_loss < 0) first_loss = j["loss"].get<double>();
    if (j.contains("val_loss")) val_loss = j["val_loss"].get<double>();
    if (j.contains("tokens_per_s")) EXPECT_GT(j["tokens_per_s"].get<double>(), 0);
  }
  ASSERT_GT(first_loss, 0);
  ASSERT_GT(val_loss, 0) << "no validation loss logged";
  // Measured 2026-11-22 on 2 cores: train loss 2.81 at step 50, 2.14 at step 600; val loss
  // 2.07 (ppl 7.9) after 600 steps, ~72 s. Uniform guessing would be ln(256) = 5.5.
  EXPECT_GT(first_loss, val_loss + 0.4);
  EXPECT_LT(val_loss, 2.4);
  EXPECT_TRUE(std::filesystem::exists(r.out_dir + "/checkpoints/step_00000600/manifest.json"));
}
