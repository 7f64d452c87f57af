// token_shards: batches are a pure function of (seed, step, rank, world); within an epoch no
// window repeats; ranks read disjoint windows that together make the step's; a resumed run
// reads exactly what an uninterrupted one does; the dataset state gives fixed val batches.
#include <gtest/gtest.h>

#include <set>

#include "data/cursor.hpp"
#include "formats/indexed_dataset.hpp"
#include "data/token_shards.hpp"
#include "data_test_helpers.hpp"
#include "node_test_helpers.hpp"

namespace flowrun {
namespace {

namespace fs = std::filesystem;

// A shard whose token at stream position p is p (so a window shows where it came from),
// split into documents of uneven lengths.
std::string position_shard(const std::string& prefix, int64_t n_tokens) {
  IndexedDatasetWriter w(prefix, TokenDtype::UInt16);
  std::vector<int32_t> doc;
  for (int64_t p = 0; p < n_tokens; ++p) {
    doc.push_back(static_cast<int32_t>(p));
    if (doc.size() == static_cast<size_t>(7 + p % 13)) w.add_document(doc), doc.clear();
  }
  w.add_document(doc);
  w.finish();
  return prefix;
}

// PREFIX.train with n_train tokens and PREFIX.val with n_val.
std::string shards(int64_t n_train, int64_t n_val) {
  const std::string prefix = test::temp_dir("shards") + "/text";
  position_shard(prefix + ".train", n_train);
  if (n_val > 0) position_shard(prefix + ".val", n_val);
  return prefix;
}

TokenWindows windows(const std::string& prefix, int64_t seq_len) {
  return TokenWindows(std::make_shared<const IndexedDataset>(prefix), seq_len);
}

std::set<int64_t> as_set(const std::vector<int64_t>& v) { return {v.begin(), v.end()}; }


std::string graph_yaml(const std::string& path, int steps, const std::string& extra = "") {
  return "flowrun: 1\nrun: { steps: " + std::to_string(steps) + ", seed: 3, prefetch: 2 }\nnodes:\n" +
         "  data: { type: token_shards, with: { path: '" + path + "', seq_len: 8, batch: 4" + extra + " } }\n" +
         "  probe: { type: t_batch_probe, in: { batch: data.batch } }\n";
}

// ---- windows and order ---------------------------------------------------------------------

TEST(TokenWindows, NonOverlappingTargetsAtStrideSeqLen) {
  const std::string p = shards(1001, 0);
  TokenWindows w = windows(p + ".train", 10);
  EXPECT_EQ(w.count(), 100);  // (1001 - 1) / 10: the last window ends exactly at the end
  const torch::Tensor t = w.batch({0, 1, 99}).at("tokens");
  ASSERT_EQ(t.sizes(), (std::vector<int64_t>{3, 11}));
  EXPECT_EQ(t.scalar_type(), torch::kInt64);
  EXPECT_TRUE(torch::equal(t[0], torch::arange(0, 11, torch::kInt64)));
  EXPECT_TRUE(torch::equal(t[1], torch::arange(10, 21, torch::kInt64)));
  EXPECT_TRUE(torch::equal(t[2], torch::arange(990, 1001, torch::kInt64)));
  EXPECT_EQ(windows(p + ".train", 1000).count(), 1);
  EXPECT_EQ(windows(p + ".train", 1001).count(), 0);
}

TEST(TokenShardSampler, BatchDependsOnlyOnSeedStepRankWorld) {
  const std::string p = shards(5000, 0);
  TokenShardSampler a(windows(p + ".train", 16), 4, /*seed=*/9), b(windows(p + ".train", 16), 4, 9),
      c(windows(p + ".train", 16), 4, 10);
  const torch::Tensor s5 = a.batch(5, 0, 1).at("tokens");
  EXPECT_EQ(s5.sizes(), (std::vector<int64_t>{4, 17}));
  a.batch(100, 0, 1);  // another epoch in between: no effect on step 5
  EXPECT_TRUE(torch::equal(a.batch(5, 0, 1).at("tokens"), s5));
  EXPECT_TRUE(torch::equal(b.batch(5, 0, 1).at("tokens"), s5));
  EXPECT_FALSE(torch::equal(c.batch(5, 0, 1).at("tokens"), s5));
  EXPECT_FALSE(torch::equal(a.batch(6, 0, 1).at("tokens"), s5));
  // Each row is a window: consecutive positions starting at a multiple of seq_len.
  for (int64_t i = 0; i < 4; ++i) {
    const int64_t start = s5[i][0].item<int64_t>();
    EXPECT_EQ(start % 16, 0);
    EXPECT_TRUE(torch::equal(s5[i], torch::arange(start, start + 17, torch::kInt64)));
  }
}

TEST(TokenShardSampler, AnEpochVisitsEachWindowOnceThenReshuffles) {
  const std::string p = shards(1001, 0);
  TokenShardSampler s(windows(p + ".train", 10), 8, 1);  // 100 windows: 12 steps per epoch, 4 left over
  ASSERT_EQ(s.steps_per_epoch(1), 12);
  std::set<int64_t> epoch0, epoch1;
  for (int64_t step = 1; step <= 12; ++step)
    for (int64_t w : s.windows_for_step(step, 0, 1)) EXPECT_TRUE(epoch0.insert(w).second) << "window " << w << " twice";
  for (int64_t step = 13; step <= 24; ++step)
    for (int64_t w : s.windows_for_step(step, 0, 1)) EXPECT_TRUE(epoch1.insert(w).second);
  EXPECT_EQ(epoch0.size(), 96u);
  EXPECT_EQ(epoch1.size(), 96u);
  EXPECT_NE(s.windows_for_step(1, 0, 1), s.windows_for_step(13, 0, 1));  // a new order
  EXPECT_NE(epoch0, epoch1);  // and other windows left over
}

TEST(TokenShardSampler, RanksReadDisjointSlicesThatCoverTheStep) {
  const std::string p = shards(3000, 0);
  TokenShardSampler per_rank(windows(p + ".train", 16), 4, 5), whole(windows(p + ".train", 16), 8, 5);
  ASSERT_EQ(per_rank.steps_per_epoch(2), whole.steps_per_epoch(1));
  for (int64_t step : {1, 2, 7, 23, 24, 25, 60}) {  // across epoch boundaries too (23 steps per epoch)
    const std::vector<int64_t> r0 = per_rank.windows_for_step(step, 0, 2), r1 = per_rank.windows_for_step(step, 1, 2);
    std::set<int64_t> both = as_set(r0);
    for (int64_t w : r1) EXPECT_TRUE(both.insert(w).second) << "step " << step << ": window " << w << " on both ranks";
    EXPECT_EQ(both, as_set(whole.windows_for_step(step, 0, 1))) << "step " << step;
  }
  EXPECT_THROW(per_rank.windows_for_step(1, 2, 2), std::invalid_argument);
}

TEST(TokenShardSampler, TwoRanksOfBatchBReadOneProcessesBatch2BRowForRow) {
  // Data parallel equivalence: rank 0's rows then rank 1's are world 1's batch of 2B, in order.
  const std::string p = shards(3000, 0);
  const int64_t B = 4;
  TokenShardSampler per_rank(windows(p + ".train", 16), B, 5), whole(windows(p + ".train", 16), 2 * B, 5);
  for (int64_t step : {1, 3, 23, 24, 47}) {  // 23 steps per epoch: the second and third epochs too
    const torch::Tensor both = torch::cat({per_rank.batch(step, 0, 2).at("tokens"), per_rank.batch(step, 1, 2).at("tokens")});
    EXPECT_TRUE(torch::equal(both, whole.batch(step, 0, 1).at("tokens"))) << "step " << step;
  }
}

TEST(TokenShardSampler, TooFewWindowsForOneStepIsAnErrorNamingTheFile) {
  const std::string p = shards(100, 0);
  TokenShardSampler s(windows(p + ".train", 16), 4, 1);  // 6 windows
  try {
    s.steps_per_epoch(2);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(p + ".train.{bin,idx}: 100 tokens make 6 windows"), std::string::npos) << e.what();
  }
}

// ---- the node in a graph -------------------------------------------------------------------

TEST(TokenShardsNode, EmitsTheSamplersBatchAndCountsTheCursor) {
  const std::string p = shards(2000, 300);
  auto g = test::load_graph_at(graph_yaml(p, 30));  // 2000 tokens: 249 windows of 8+1, 62 steps per epoch
  const auto seen = test::run_and_probe(*g);
  TokenShardSampler ref(windows(p + ".train", 8), 4, /*run.seed=*/3);
  ASSERT_EQ(seen.size(), 30u);
  for (const auto& [step, batch] : seen) EXPECT_TRUE(torch::equal(batch.at("tokens"), ref.batch(step, 0, 1).at("tokens"))) << step;
  EXPECT_EQ(g->state<DataCursor>("data", "cursor").batches, 30);
}

TEST(TokenShardsNode, TwoRanksReadDisjointBatches) {
  const std::string p = shards(2000, 0);
  auto r0 = test::load_graph_at(graph_yaml(p, 5, ", seed: 11"), 0, 2);
  const auto seen0 = test::run_and_probe(*r0);
  auto r1 = test::load_graph_at(graph_yaml(p, 5, ", seed: 11"), 1, 2);
  const auto seen1 = test::run_and_probe(*r1);
  TokenShardSampler ref(windows(p + ".train", 8), 4, 11);
  for (int64_t s = 1; s <= 5; ++s) {
    const torch::Tensor a = seen0.at(s).at("tokens"), b = seen1.at(s).at("tokens");
    EXPECT_TRUE(torch::equal(a, ref.batch(s, 0, 2).at("tokens")));
    EXPECT_TRUE(torch::equal(b, ref.batch(s, 1, 2).at("tokens")));
    std::set<int64_t> starts;
    for (int64_t i = 0; i < 4; ++i) starts.insert(a[i][0].item<int64_t>()), starts.insert(b[i][0].item<int64_t>());
    EXPECT_EQ(starts.size(), 8u) << "step " << s << ": a window on both ranks";
  }
}

TEST(TokenShardsNode, AResumedRunReadsWhatAnUninterruptedRunReads) {
  const std::string p = shards(1000, 0);  // 124 windows, 31 steps per epoch: run across the epoch end
  auto full = test::load_graph_at(graph_yaml(p, 40));
  const auto want = test::run_and_probe(*full);
  // Resume after step 29, as from a checkpoint whose cursor says 29 batches were drawn.
  auto resumed = test::load_graph_at(graph_yaml(p, 40), 0, 1, /*first_step=*/30);
  resumed->state<DataCursor>("data", "cursor").batches = 29;
  const auto got = test::run_and_probe(*resumed);
  ASSERT_EQ(got.size(), 11u);
  for (int64_t s = 30; s <= 40; ++s) EXPECT_TRUE(torch::equal(got.at(s).at("tokens"), want.at(s).at("tokens"))) << "step " << s;
  EXPECT_EQ(resumed->state<DataCursor>("data", "cursor").batches, 40);
}

TEST(TokenShardsNode, ACursorFromAnotherStepIsAnError) {
  const std::string p = shards(1000, 0);
  auto g = test::load_graph_at(graph_yaml(p, 12), 0, 1, /*first_step=*/10);
  g->state<DataCursor>("data", "cursor").batches = 4;  // not 9
  try {
    g->run();
    FAIL() << "no error";
  } catch (const NodeError& e) {
    EXPECT_EQ(e.node, "data");
    EXPECT_EQ(e.step, 10);
    EXPECT_NE(std::string(e.what()).find("cursor says 4 batches were drawn, but this is step 10"), std::string::npos) << e.what();
  }
}

// Issue 47: shards rebuilt between a run and its resume (from more documents, or another corpus
// of the same length) were read on from the old cursor. The cursor keeps what it read.
TEST(TokenShardsNode, AResumeOverChangedDataIsRefusedOrReadOnWithAWarning) {
  const std::string p = shards(1000, 0);
  auto first = test::load_graph_at(graph_yaml(p, 5));
  first->run();
  const auto saved = first->state<DataCursor>("data", "cursor").tensors();
  auto cursor_of = [&](const std::string& extra = "") {
    auto g = test::load_graph_at(graph_yaml(p, 9, extra), 0, 1, /*first_step=*/6);
    DataCursor c = g->state<DataCursor>("data", "cursor");
    return c;
  };
  DataCursor same = cursor_of();
  same.load(saved);  // the same data: loads
  EXPECT_EQ(same.batches, 5);
  auto refused = [&](const std::string& why) {
    DataCursor c = cursor_of();
    try {
      c.load(saved);
      ADD_FAILURE() << why << ": no error";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("the cursor was saved over other data than this reader's: then 124 items"),
                std::string::npos) << why << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find("on_data_change: continue"), std::string::npos) << e.what();
    }
  };
  position_shard(p + ".train", 1200);  // grown
  refused("grown");
  {  // another corpus, as long: every token + 1
    IndexedDatasetWriter w(p + ".train", TokenDtype::UInt16);
    std::vector<int32_t> doc;
    for (int64_t t = 0; t < 1000; ++t) {
      doc.push_back(static_cast<int32_t>(t + 1));
      if (doc.size() == static_cast<size_t>(7 + t % 13)) w.add_document(doc), doc.clear();
    }
    w.add_document(doc);
    w.finish();
  }
  refused("another corpus of the same length");
  DataCursor go_on = cursor_of(", on_data_change: continue");
  go_on.load(saved);  // told so: reads on (a warning)
  EXPECT_EQ(go_on.batches, 5);
  DataCursor old_checkpoint = cursor_of();
  old_checkpoint.load({{"batches", torch::tensor(int64_t{5})}});  // written before fingerprints: nothing to compare
  EXPECT_EQ(old_checkpoint.batches, 5);
}

TEST(TokenShardsNode, MissingOrCorruptShardsAreErrorsNamingTheFile) {
  const std::string dir = test::temp_dir("tsnode");
  auto setup_error = [](const std::string& yaml) -> std::string {
    try {
      test::load_graph_at(yaml);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "no error";
  };
  std::string e = setup_error(graph_yaml(dir + "/none", 1));
  EXPECT_NE(e.find("no token shards at " + dir + "/none.train.{bin,idx}"), std::string::npos) << e;
  const std::string p = shards(2000, 0);
  fs::resize_file(p + ".train.bin", 100);
  e = setup_error(graph_yaml(p, 1));
  EXPECT_NE(e.find(p + ".train.bin: sequence"), std::string::npos) << e;
  EXPECT_NE(e.find("past the end of the file"), std::string::npos) << e;
  e = setup_error(graph_yaml(shards(20, 0), 1));  // 2 windows < batch 4
  EXPECT_NE(e.find("use a smaller seq_len or batch"), std::string::npos) << e;
}

// ---- the dataset state ---------------------------------------------------------------------

TEST(TokenShardsDataset, FixedValBatchesInFileOrderShardedByRank) {
  const std::string p = shards(2000, 401);  // val: 50 windows of 8+1
  auto g = test::load_graph_at(graph_yaml(p, 1));
  auto& ds = g->state<Dataset>("data", "dataset");
  EXPECT_EQ(ds.splits(), (std::vector<std::string>{"train", "val"}));
  EXPECT_EQ(ds.num_batches("val", 5, 0, 1), 10);
  EXPECT_EQ(ds.num_batches("val", 5, 1, 2), 5);
  // Batch 3 of rank 1 in a world of 2: windows 3*10 + 5 .. +5, i.e. tokens from 35*8 on.
  const torch::Tensor t = ds.batch("val", 3, 5, 1, 2).at("tokens");
  ASSERT_EQ(t.sizes(), (std::vector<int64_t>{5, 9}));
  for (int64_t j = 0; j < 5; ++j) EXPECT_TRUE(torch::equal(t[j], torch::arange((35 + j) * 8, (35 + j) * 8 + 9, torch::kInt64)));
  EXPECT_TRUE(torch::equal(ds.batch("val", 3, 5, 1, 2).at("tokens"), t));  // the same every time
  EXPECT_THROW(ds.batch("val", 5, 5, 1, 2), std::out_of_range);
  EXPECT_THROW(ds.num_batches("test", 5, 0, 1), std::invalid_argument);
  // Rank 0's then rank 1's batch i of 5 rows are batch i of 10 rows of one process.
  for (int64_t i : {0, 2, 4})
    EXPECT_TRUE(torch::equal(torch::cat({ds.batch("val", i, 5, 0, 2).at("tokens"), ds.batch("val", i, 5, 1, 2).at("tokens")}),
                             ds.batch("val", i, 10, 0, 1).at("tokens")))
        << "batch " << i;
  // Without val files, the dataset has train only.
  auto g2 = test::load_graph_at(graph_yaml(shards(2000, 0), 1));
  EXPECT_EQ(g2->state<Dataset>("data", "dataset").splits(), (std::vector<std::string>{"train"}));
}

}  // namespace
}  // namespace flowrun
