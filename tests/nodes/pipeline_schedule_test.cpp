// Pipeline schedules (nodes/parallel/pipeline_schedule.hpp): one rule makes GPipe, 1F1B,
// interleaved 1F1B and zero-bubble; each is checked against what its paper says it is.
#include <gtest/gtest.h>

#include <set>
#include <tuple>

#include "parallel/pipeline_schedule.hpp"

namespace pl = flowrun::parallel::pipeline;
using pl::Kind;
using pl::Op;

namespace {

pl::Schedule schedule(Kind k, int p, int m, int v = 1) {
  pl::Config c;
  c.stages = p;
  c.microbatches = m;
  c.kind = k;
  c.virtual_stages = v;
  return pl::make(c);
}

// Every operation once, on the rank of its chunk, after what it needs (by the simulated times).
void expect_valid(const pl::Schedule& s) {
  const int C = s.config.chunks(), M = s.config.microbatches;
  std::map<std::tuple<int, int, int>, std::pair<double, double>> when;  // (type, chunk, mb) -> (start, end)
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    double free = 0;
    for (const pl::Slot& slot : s.ranks[r]) {
      EXPECT_EQ(s.rank_of(slot.op.chunk), static_cast<int>(r)) << pl::str(slot.op);
      EXPECT_GE(slot.start, free) << "two operations at once on rank " << r;
      free = slot.end;
      EXPECT_TRUE(when.emplace(std::make_tuple(int(slot.op.type), slot.op.chunk, slot.op.mb),
                               std::make_pair(slot.start, slot.end)).second) << pl::str(slot.op) << " twice";
    }
  }
  const bool split = s.config.kind == Kind::zero_bubble;
  EXPECT_EQ(when.size(), static_cast<size_t>((split ? 3 : 2) * C * M));
  for (const auto& [op, t] : when) {
    const auto [type, k, m] = op;
    auto end = [&](Op::Type ty, int kk) { return when.at(std::make_tuple(int(ty), kk, m)).second; };
    if (type == Op::F && k > 0) EXPECT_GE(t.first, end(Op::F, k - 1));
    if (type == Op::B) {
      EXPECT_GE(t.first, end(Op::F, k));
      if (k < C - 1) EXPECT_GE(t.first, end(Op::B, k + 1));
    }
    if (type == Op::W) EXPECT_GE(t.first, end(Op::B, k));
  }
}

}  // namespace

// 1F1B (Narayanan et al. 2019) with B twice F: the first stage idles (p - 1) / (M + p - 1) of its
// step, and stage s holds at most p - s micro-batches' activations.
TEST(PipelineSchedule, OneFOneBHasTheTextbookBubbleAndHoldsPMinusSMicroBatches) {
  for (int p : {2, 3, 4})
    for (int m : {4, 8, 16}) {
      const pl::Schedule s = schedule(Kind::one_f_one_b, p, m);
      expect_valid(s);
      EXPECT_NEAR(s.bubble(0), double(p - 1) / (m + p - 1), 1e-9) << "p " << p << " M " << m;
      for (int r = 0; r < p; ++r) EXPECT_EQ(s.peak_in_flight(r), std::min(p - r, m)) << "rank " << r;
      // Makespan (M + p - 1)(F + B).
      EXPECT_DOUBLE_EQ(s.makespan, 3.0 * (m + p - 1));
    }
}

// GPipe: every forward, then every backward; the same bubble, but all M micro-batches held.
TEST(PipelineSchedule, GPipeRunsEveryForwardFirstAndHoldsEveryMicroBatch) {
  const pl::Schedule s = schedule(Kind::gpipe, 4, 8);
  expect_valid(s);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(s.peak_in_flight(r), 8);
    for (int i = 0; i < 8; ++i) EXPECT_EQ(s.ranks[static_cast<size_t>(r)][static_cast<size_t>(i)].op.type, Op::F);
  }
  EXPECT_NEAR(s.bubble(0), 3.0 / 11.0, 1e-9);
}

// The first stage's program under 1F1B at p = 2, M = 4, as Megatron-LM runs it: one warm-up
// forward, then alternating, then the last backward.
TEST(PipelineSchedule, OneFOneBProgramOfTheFirstStage) {
  const pl::Schedule s = schedule(Kind::one_f_one_b, 2, 4);
  std::vector<std::string> program;
  for (const pl::Slot& slot : s.ranks[0]) program.push_back(pl::str(slot.op));
  EXPECT_EQ(program, (std::vector<std::string>{"F0.0", "F1.0", "B0.0", "F2.0", "B1.0", "F3.0", "B2.0", "B3.0"}));
  const std::vector<std::string> text = s.render();
  EXPECT_EQ(text[0], "stage 0: F0 F1 .. B0 F2 B1 F3 B2 .. B3   (bubble 20 %, holds at most 2 micro-batches)");
}

// Zero bubble (ZB-H1, Qi et al. 2023): B split into the input gradient and the weight gradient,
// the W's filling the bubbles at 1F1B's activations (p - s held): with F = B = W the first stage
// idles (p - 1) / (3M + p - 1), the paper's (p - 1)(F + B - W) against 1F1B's (p - 1)(F + B + W).
TEST(PipelineSchedule, ZeroBubbleFillsTheBubblesWithWeightGradientsAtOneFOneBsMemory) {
  for (int p : {2, 4})
    for (int m : {4, 8, 16}) {
      const pl::Schedule zb = schedule(Kind::zero_bubble, p, m), base = schedule(Kind::one_f_one_b, p, m);
      expect_valid(zb);
      for (int r = 0; r < p; ++r) {
        EXPECT_LE(zb.peak_in_flight(r), p - r);
        EXPECT_LT(zb.bubble(r), base.bubble(r) + 1e-9) << "rank " << r;
      }
      EXPECT_NEAR(zb.bubble(0), double(p - 1) / (3 * m + p - 1), 1e-9) << "p " << p << " M " << m;
      EXPECT_LT(zb.makespan, base.makespan);
    }
}

// Costs time the program the rule makes at unit costs (what forward_backward runs) and do not
// reorder it: each rank runs the same operations in the same order, each once its inputs are there;
// twice every cost is twice every time.
TEST(PipelineSchedule, CostsTimeTheUnitCostProgramWithoutReorderingIt) {
  for (Kind k : {Kind::gpipe, Kind::one_f_one_b, Kind::interleaved, Kind::zero_bubble}) {
    const int v = k == Kind::interleaved ? 2 : 1;
    const pl::Schedule unit = schedule(k, 2, 4, v);
    pl::Config uneven = unit.config, twice = unit.config;
    const int C = unit.config.chunks();
    for (int c = 0; c < C; ++c) {
      // The last chunk's forward is slow and its W's are long: the rule at these costs would
      // order some operations otherwise.
      uneven.f.push_back(c == C - 1 ? 3.0 : 0.5);
      uneven.b.push_back(1.0 + c);
      uneven.w.push_back(c == 0 ? 4.0 : 0.2);
      twice.f.push_back(2), twice.b.push_back(2), twice.w.push_back(2);
    }
    const pl::Schedule a = pl::make(uneven), b = pl::make(twice);
    expect_valid(a);
    for (size_t r = 0; r < unit.ranks.size(); ++r) {
      ASSERT_EQ(a.ranks[r].size(), unit.ranks[r].size());
      for (size_t i = 0; i < unit.ranks[r].size(); ++i) {
        EXPECT_EQ(a.ranks[r][i].op, unit.ranks[r][i].op) << pl::name(k) << " rank " << r << " op " << i;
        EXPECT_DOUBLE_EQ(b.ranks[r][i].start, 2 * unit.ranks[r][i].start);
        EXPECT_DOUBLE_EQ(b.ranks[r][i].end, 2 * unit.ranks[r][i].end);
      }
    }
    EXPECT_DOUBLE_EQ(b.makespan, 2 * unit.makespan);
  }
}

// Interleaved 1F1B (Narayanan et al. 2021): V chunks a rank, chunk k on rank k % p; the bubble
// shrinks about V times, for more micro-batches held.
TEST(PipelineSchedule, InterleavedShrinksTheBubbleWithVirtualStages) {
  const pl::Schedule one = schedule(Kind::one_f_one_b, 2, 4), two = schedule(Kind::interleaved, 2, 4, 2);
  expect_valid(two);
  EXPECT_LT(two.bubble(0), one.bubble(0));
  std::set<int> chunks;
  for (const pl::Slot& slot : two.ranks[1]) chunks.insert(slot.op.chunk);
  EXPECT_EQ(chunks, (std::set<int>{1, 3}));
  expect_valid(schedule(Kind::interleaved, 4, 8, 2));
  expect_valid(schedule(Kind::interleaved, 2, 6, 3));
  // Megatron-LM's program (its warm-up forwards, then one forward and one backward in turn, each in
  // its order) has Narayanan et al.'s bubble at unit costs, (p - 1) / (V M + p - 1), at any number
  // of micro-batch groups (pp 4 at 16 and 32 micro-batches once filled a stage's limit with
  // forwards whose backwards could not start).
  for (int p : {2, 4})
    for (int M : {p, 2 * p, 4 * p, 16, 32})
      for (int V : {2, 3}) {
        const pl::Schedule s = schedule(Kind::interleaved, p, M, V);
        expect_valid(s);
        EXPECT_NEAR(s.bubble(0), (p - 1.0) / (V * M + p - 1.0), 1e-9) << "p " << p << " M " << M << " V " << V;
      }
}

TEST(PipelineSchedule, SettingsThatMakeNoScheduleAreRefusedNamingThem) {
  auto refused = [](Kind k, int p, int m, int v, const std::string& says) {
    pl::Config c;
    c.stages = p;
    c.microbatches = m;
    c.kind = k;
    c.virtual_stages = v;
    try {
      pl::make(c);
      ADD_FAILURE() << "accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused(Kind::one_f_one_b, 2, 4, 2, "virtual stages are the interleaved schedule's");
  refused(Kind::interleaved, 4, 6, 2, "set run.parallel.microbatches to a multiple of it");
  EXPECT_THROW(pl::parse_kind("pipedream"), std::invalid_argument);
  EXPECT_EQ(pl::parse_kind("zero_bubble"), Kind::zero_bubble);
}

// Stages balanced by cost: equal blocks split evenly; a costly head (GPT's tied LM head) leaves
// the last chunk fewer blocks.
TEST(PipelineSchedule, BlocksAreBalancedByCostOrTakenAsGiven) {
  EXPECT_EQ(pl::balance(std::vector<double>(8, 1.0), 4),
            (std::vector<std::pair<int, int>>{{0, 2}, {2, 4}, {4, 6}, {6, 8}}));
  EXPECT_EQ(pl::balance(std::vector<double>(5, 1.0), 2), (std::vector<std::pair<int, int>>{{0, 3}, {3, 5}}));
  EXPECT_EQ(pl::balance(std::vector<double>(8, 1.0), 2, 0.0, 4.0), (std::vector<std::pair<int, int>>{{0, 6}, {6, 8}}));
  EXPECT_THROW(pl::balance(std::vector<double>(2, 1.0), 4), std::invalid_argument);
  EXPECT_EQ(pl::given({1, 3}, 4, 2), (std::vector<std::pair<int, int>>{{0, 1}, {1, 4}}));
  EXPECT_THROW(pl::given({1, 2}, 4, 2), std::invalid_argument);
  EXPECT_THROW(pl::given({4}, 4, 2), std::invalid_argument);
}
