// Small file helpers (nodes/formats/files.hpp): moving an earlier run's files aside.
#include <gtest/gtest.h>

#include <filesystem>

#include "formats/files.hpp"
#include "support/run_graph.hpp"

namespace flowrun {
namespace {

namespace fs = std::filesystem;

// Issue 47: a fresh start renamed metrics.jsonl to metrics.previous-STAMP.jsonl with a
// one-second stamp, replacing a file of that name (a clock set back, two starts in a second).
TEST(MoveAside, NeverReplacesAnythingANumberIsAddedInstead) {
  const std::string dir = test::temp_dir("aside");
  const std::string base = dir + "/metrics.previous-20261128-120000";
  test::write_text(dir + "/metrics.jsonl", "run 1\n");
  EXPECT_EQ(move_aside(dir + "/metrics.jsonl", base, ".jsonl"), base + ".jsonl");
  test::write_text(dir + "/metrics.jsonl", "run 2\n");
  EXPECT_EQ(move_aside(dir + "/metrics.jsonl", base, ".jsonl"), base + "-2.jsonl");
  test::write_text(dir + "/metrics.jsonl", "run 3\n");
  EXPECT_EQ(move_aside(dir + "/metrics.jsonl", base, ".jsonl"), base + "-3.jsonl");
  EXPECT_EQ(read_file(base + ".jsonl"), "run 1\n");
  EXPECT_EQ(read_file(base + "-2.jsonl"), "run 2\n");
  EXPECT_EQ(read_file(base + "-3.jsonl"), "run 3\n");
  EXPECT_FALSE(fs::exists(dir + "/metrics.jsonl"));
  // Folders the same way (tb/), and a name taken by a folder is not a file's either.
  fs::create_directories(dir + "/tb/a");
  EXPECT_EQ(move_aside(dir + "/tb", base, ".jsonl"), base + "-4.jsonl");
  EXPECT_TRUE(fs::is_directory(base + "-4.jsonl/a"));
  // Nothing to move: an error naming it, nothing changed.
  EXPECT_THROW(move_aside(dir + "/gone", base, ".jsonl"), fs::filesystem_error);
  EXPECT_FALSE(fs::exists(base + "-5.jsonl"));
}

TEST(MoveAside, NewFoldersAreNeverOnesThatExist) {
  const std::string dir = test::temp_dir("aside");
  EXPECT_EQ(make_new_dir(dir + "/ckpt.previous-1"), dir + "/ckpt.previous-1");
  test::write_text(dir + "/ckpt.previous-1/x", "kept");
  EXPECT_EQ(make_new_dir(dir + "/ckpt.previous-1"), dir + "/ckpt.previous-1-2");
  EXPECT_EQ(read_file(dir + "/ckpt.previous-1/x"), "kept");
  EXPECT_TRUE(fs::is_empty(dir + "/ckpt.previous-1-2"));
}

}  // namespace
}  // namespace flowrun
