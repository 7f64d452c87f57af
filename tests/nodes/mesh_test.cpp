// The parallel mesh (nodes/parallel/mesh.hpp): run.parallel's dp x pp x tp grid of processes,
// tp fastest, as Megatron-LM lays out its ranks.
#include <gtest/gtest.h>

#include <chrono>

#include <array>

#include <set>

#include "parallel/mesh.hpp"

using flowrun::parallel::Dim;
using flowrun::parallel::Mesh;

TEST(Mesh, TheDataParallelSizeIsWhatTheWorldLeaves) {
  const Mesh m(8, /*tp=*/2, /*pp=*/2);
  EXPECT_EQ(m.size(Dim::dp), 2);
  EXPECT_EQ(m.size(Dim::pp), 2);
  EXPECT_EQ(m.size(Dim::tp), 2);
  EXPECT_EQ(m.describe(), "dp 2 x pp 2 x tp 2 (8 processes)");
  EXPECT_EQ(Mesh().describe(), "dp 1 x pp 1 x tp 1 (1 process)");
  EXPECT_EQ(Mesh(6, 1, 1).size(Dim::dp), 6);
}

TEST(Mesh, ALayoutTheWorldDoesNotDivideIsRefusedNamingTheNumbers) {
  try {
    Mesh(6, 4, 1);
    FAIL() << "tp 4 over 6 processes was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("tp 4 x pp 1 = 4 does not divide the 6 processes"), std::string::npos) << what;
    EXPECT_NE(what.find("launch a multiple of 4 processes"), std::string::npos) << what;
  }
  EXPECT_THROW(Mesh(4, 0, 1), std::invalid_argument);
}

// Rank r = (dp * pp_size + pp) * tp_size + tp: coordinates and ranks are inverse, every rank
// once; the tp ranks of a replica are neighbours.
TEST(Mesh, CoordinatesAndRanksAreInverseWithTpFastest) {
  const Mesh m(12, 2, 3);
  std::set<int> seen;
  for (int r = 0; r < 12; ++r) {
    const Mesh::Coord c = m.coord(r);
    EXPECT_EQ(m.rank_of(c), r);
    EXPECT_TRUE(seen.insert(c.dp * 100 + c.pp * 10 + c.tp).second) << r;
  }
  EXPECT_EQ(m.coord(5).tp, 1);
  EXPECT_EQ(m.coord(5).pp, 2);
  EXPECT_EQ(m.coord(5).dp, 0);
  EXPECT_EQ(m.coord(6).dp, 1);
  EXPECT_THROW(m.coord(12), std::out_of_range);
}

// A group along a dimension: the ranks that differ only there, in that coordinate's order; the
// groups along one dimension partition the world, and color() names them alike for members only.
TEST(Mesh, GroupsAlongADimensionPartitionTheWorld) {
  const Mesh m(8, 2, 1);
  EXPECT_EQ(m.group(Dim::tp, 5), (std::vector<int>{4, 5}));
  EXPECT_EQ(m.group(Dim::dp, 5), (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(m.group(Dim::pp, 5), (std::vector<int>{5}));
  const Mesh big(24, 2, 3);
  for (Dim d : {Dim::dp, Dim::pp, Dim::tp}) {
    std::set<int> colors;
    for (int r = 0; r < 24; ++r) {
      const std::vector<int> g = big.group(d, r);
      ASSERT_EQ(static_cast<int>(g.size()), big.size(d));
      EXPECT_EQ(g[static_cast<size_t>(big.at(big.coord(r), d))], r) << "rank " << r << " sits at its coordinate";
      for (int other : g) EXPECT_EQ(big.color(d, other), big.color(d, r));
      colors.insert(big.color(d, r));
    }
    EXPECT_EQ(static_cast<int>(colors.size()), 24 / big.size(d)) << flowrun::parallel::name(d);
    EXPECT_EQ(*colors.begin(), 0);
    EXPECT_EQ(*colors.rbegin(), 24 / big.size(d) - 1);
  }
}

TEST(Mesh, TheTableGivesEachRanksCoordinatesAndGroups) {
  const std::vector<std::string> t = Mesh(4, 2, 1).table();
  ASSERT_EQ(t.size(), 4u);
  EXPECT_EQ(t[3], "rank 3: dp 1, pp 0, tp 1; tp group {2, 3}, dp group {1, 3}");
  EXPECT_EQ(Mesh(2, 1, 1).table()[1], "rank 1: dp 1, pp 0, tp 0; dp group {0, 1}");
  EXPECT_EQ(Mesh().table()[0], "rank 0: dp 0, pp 0, tp 0");
}

// Issue 69: `flowrun explain --world N` printed every rank's whole dp group, N² in all: 4096 ranks
// wrote 96 MB, 65536 never finished. Over 16 ranks the table is the rule, 8 ranks and the last,
// groups as progressions: a few lines at any size, in well under a second.
TEST(Mesh, TheTableOfAHugeWorldIsAFewLinesInBoundedTime) {
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& [world, tp, pp] : std::vector<std::array<int, 3>>{{65536, 2, 1}, {1 << 20, 8, 4}, {17, 1, 1}}) {
    const std::vector<std::string> t = Mesh(world, tp, pp).table();
    ASSERT_EQ(t.size(), 11u) << world;
    size_t chars = 0;
    for (const auto& l : t) chars += l.size();
    EXPECT_LT(chars, 2000u) << world;
    EXPECT_EQ(t[0].rfind("rank r: tp = r mod " + std::to_string(tp), 0), 0u) << t[0];
    EXPECT_EQ(t[9], "...");
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0);
  const std::vector<std::string> t = Mesh(65536, 2, 1).table();
  EXPECT_EQ(t[1], "rank 0: dp 0, pp 0, tp 0; tp group {0, 1}, dp group {0, 2, 4, ..., 65534} (32768 ranks, step 2)");
  EXPECT_EQ(t[10], "rank 65535: dp 32767, pp 0, tp 1; tp group {65534, 65535}, dp group {1, 3, 5, ..., 65535} (32768 ranks, step 2)");
  EXPECT_EQ(Mesh(16, 1, 1).table().size(), 16u);  // up to 16: every rank, as before
}

TEST(Mesh, ALayoutOfSeveralProcessesInASingleOneSaysHowToLaunchIt) {
  try {
    Mesh(1, 2, 1);
    FAIL() << "tp 2 in a single process was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("this is a single process; launch a multiple of 2 (mpirun -np 2 flowrun ...)"),
              std::string::npos)
        << e.what();
  }
}

// Expert parallel is cut out of dp (ep fastest within it): the ep group shares one set of experts
// between its ranks, the edp group holds the same experts; both partition every dp group.
TEST(Mesh, ExpertParallelIsCutOutOfDataParallel) {
  const Mesh m(8, /*tp=*/2, /*pp=*/1, /*ep=*/2);  // dp 4 = edp 2 x ep 2
  EXPECT_EQ(m.size(Dim::ep), 2);
  EXPECT_EQ(m.size(Dim::edp), 2);
  EXPECT_EQ(m.describe(), "dp 4 (ep 2) x pp 1 x tp 2 (8 processes)");
  // Rank 5 = (dp 2, tp 1): ep coordinate 0, edp 1.
  EXPECT_EQ(m.group(Dim::dp, 5), (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(m.group(Dim::ep, 5), (std::vector<int>{5, 7}));
  EXPECT_EQ(m.group(Dim::edp, 5), (std::vector<int>{1, 5}));
  EXPECT_EQ(m.table()[5], "rank 5: dp 2 (ep 0), pp 0, tp 1; tp group {4, 5}, dp group {1, 3, 5, 7}, ep group {5, 7}, edp group {1, 5}");
  const Mesh big(48, 2, 3, 4);  // dp 8 = edp 2 x ep 4
  for (Dim d : {Dim::ep, Dim::edp}) {
    std::set<int> colors;
    for (int r = 0; r < 48; ++r) {
      const std::vector<int> g = big.group(d, r);
      ASSERT_EQ(static_cast<int>(g.size()), big.size(d));
      EXPECT_EQ(g[static_cast<size_t>(big.at(big.coord(r), d))], r) << "rank " << r << " sits at its coordinate";
      for (int other : g) EXPECT_EQ(big.color(d, other), big.color(d, r));
      colors.insert(big.color(d, r));
    }
    EXPECT_EQ(static_cast<int>(colors.size()), 48 / big.size(d)) << flowrun::parallel::name(d);
    EXPECT_EQ(*colors.rbegin(), 48 / big.size(d) - 1);
  }
  try {
    Mesh(6, 1, 1, 4);
    FAIL() << "ep 4 does not divide dp 6";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("ep 4 does not divide the data-parallel size 6"), std::string::npos) << e.what();
  }
}
