// HunyuanDiT's data as its users have it: Arrow files written by its csv2arrow.py, under Index V2
// JSONs made by IndexKits (tests/fixtures/arrow/, with what IndexKits' own ArrowIndexV2 and
// MultiResolutionBucketIndexV2 give for them in expected.json), read by the image_text_shards
// node: the same images, captions and sizes, the index's buckets, resume, and each bad input an
// error naming the file and row. (The index itself: tests/formats/index_v2_test.cpp.)
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <map>
#include <numeric>

#include "data/arrow_image_text.hpp"
#include "data/cursor.hpp"
#include "formats/arrow_file.hpp"
#include "formats/image_io.hpp"
#include "formats/index_v2.hpp"
#include "formats/md5.hpp"
#include "hash.hpp"
#include "prep/prep_arrow.hpp"
#include "data_test_helpers.hpp"
#include "node_test_helpers.hpp"

namespace flowrun {
namespace {

const std::string kDir = std::string(FLOWRUN_SOURCE_DIR) + "/tests/fixtures/arrow";

nlohmann::json expected() { return nlohmann::json::parse(test::read_text(kDir + "/expected.json")); }

std::string graph_yaml(const std::string& path, int steps, const std::string& extra = "", int batch = 2) {
  return "flowrun: 1\nrun: { steps: " + std::to_string(steps) + ", seed: 5, prefetch: 2 }\nnodes:\n" +
         "  data: { type: image_text_shards, with: { path: '" + path + "', size: 32, batch: " + std::to_string(batch) + extra +
         " } }\n  probe: { type: t_batch_probe, in: { batch: data.batch } }\n";
}

std::string setup_error(const std::string& yaml) {
  try {
    test::load_graph_at(yaml);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

#define REQUIRE_ARROW()                                                                                     \
  if (!arrow_available()) {                                                                                 \
    /* Built without Arrow: the node refuses Arrow data, saying what to install. */                         \
    const std::string e = setup_error(graph_yaml(kDir + "/index_base.json", 1));                            \
    EXPECT_NE(e.find("built without Apache Arrow"), std::string::npos) << e;                                \
    EXPECT_NE(e.find("pip install pyarrow"), std::string::npos) << e;                                       \
    return;                                                                                                 \
  }

TEST(ArrowFile, ReadsCsv2ArrowFilesAsPyarrowSeesThem) {
  REQUIRE_ARROW();
  const nlohmann::json files = expected()["arrow_files"];  // a copy: the range of a loop outlives no temporary
  for (const nlohmann::json& want : files) {
    ArrowFile f(kDir + "/" + want["path"].get<std::string>());
    EXPECT_EQ(f.rows(), want["num_rows"].get<int64_t>());
    const auto& fields = want["fields"];
    ASSERT_EQ(f.columns().size(), fields.size());
    for (size_t c = 0; c < fields.size(); ++c) {
      EXPECT_EQ(f.columns()[c], fields[c]["name"].get<std::string>());
      EXPECT_EQ(f.type_name(static_cast<int>(c)), fields[c]["type"].get<std::string>());
    }
  }
  // Written and read back: what `flowrun prep arrow` writes.
  const std::string path = test::temp_dir("arrow") + "/x.arrow";
  write_arrow_file(path, {{"text_zh", ArrowKind::string, {"一只猫", "b"}, {}},
                          {"width", ArrowKind::integer, {}, {7, 9}},
                          {"image", ArrowKind::binary, {std::string("\0\1\2", 3), ""}, {}}});
  ArrowFile f(path);
  ASSERT_EQ(f.rows(), 2);
  EXPECT_EQ(f.bytes(f.column("text_zh"), 0), "一只猫");
  EXPECT_EQ(f.integer(f.column("width"), 1), 9);
  EXPECT_EQ(f.bytes(f.column("image"), 0), std::string("\0\1\2", 3));
  EXPECT_EQ(f.kind(f.column("image")), ArrowKind::binary);
  try {
    f.integer(f.column("text_zh"), 0);
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("x.arrow: column 'text_zh' (string), row 0: expected integers"), std::string::npos) << e.what();
  }
  EXPECT_THROW(f.bytes(f.column("image"), 2), std::runtime_error);  // no row 2
}

TEST(ArrowImageText, SamplesAreTheImagesCaptionsAndSizesIndexKitsGives) {
  REQUIRE_ARROW();
  const nlohmann::json want = expected()["base"];
  ArrowImageText d(kDir + "/index_base.json", {});
  ASSERT_EQ(d.size(), want["length"].get<int64_t>());
  EXPECT_FALSE(d.multireso());
  for (int64_t i = 0; i < d.size(); ++i) {
    const nlohmann::json& w = want["items"][static_cast<size_t>(i)];
    EXPECT_EQ(d.row(i), w["index"].get<int64_t>()) << i;
    EXPECT_EQ(d.caption(i), w["text_zh"].get<std::string>()) << i;
    EXPECT_EQ(d.image_size(i).w, w["width"].get<int>()) << i;
    EXPECT_EQ(d.image_size(i).h, w["height"].get<int>()) << i;
    const Image img = d.decode(i);  // as PIL's Image.open(...).convert("RGB"): gray replicated, alpha dropped
    EXPECT_EQ(img.w, w["rgb_size"][0].get<int>()) << i;
    EXPECT_EQ(img.h, w["rgb_size"][1].get<int>()) << i;
    ASSERT_EQ(img.c, 3);
    const std::string px(img.px.begin(), img.px.end());
    if (w["format"] == "PNG") {
      EXPECT_EQ(std::to_string(fnv1a(px)), w["rgb_fnv1a"].get<std::string>()) << "row " << w["index"];
    } else {  // JPEG: libjpeg-turbo here, PIL's libjpeg there; the same picture within rounding
      const double mean = std::accumulate(img.px.begin(), img.px.end(), 0.0) / static_cast<double>(img.px.size());
      EXPECT_NEAR(mean, w["rgb_mean"].get<double>(), 1.0) << "row " << w["index"];
    }
  }
  // Arrow files given directly: every row, in order (the 40x40 image the index filters out too).
  ArrowImageText all(kDir + "/arrows/*/00000.arrow", {});
  ASSERT_EQ(all.size(), 14);
  for (int64_t i = 0; i < 14; ++i) EXPECT_EQ(all.row(i), i);
  EXPECT_EQ(all.files().size(), 2u);
}

TEST(ArrowImageTextNode, AMultiResolutionIndexTrainsInItsBucketsOnePerBatch) {
  REQUIRE_ARROW();
  // Batch 2: IndexKits aligns each bucket to 2 (expected.json, case batch 2 world 1): 22 entries,
  // 11 steps an epoch, each step's batch one bucket's size, each bucket as often as it fills.
  const nlohmann::json c = expected()["multireso"]["cases"][1];
  ASSERT_EQ(c["batch_size"], 2);
  std::map<std::pair<int64_t, int64_t>, int> want_steps;  // (h, w) -> steps an epoch
  for (const nlohmann::json& r : c["resolutions"])
    want_steps[{r["height"].get<int64_t>(), r["width"].get<int64_t>()}] = static_cast<int>(r["indices"].size()) / 2;
  auto g = test::load_graph_at(graph_yaml(kDir + "/index_multireso.json", 22, ", buckets: index"));
  const auto seen = test::run_and_probe(*g);
  ASSERT_EQ(seen.size(), 22u);
  std::map<std::pair<int64_t, int64_t>, int> steps;
  for (const auto& [step, batch] : seen) {
    const torch::Tensor img = batch.at("image");
    ASSERT_EQ(img.size(0), 2);
    const std::pair<int64_t, int64_t> hw{img.size(2), img.size(3)};
    ASSERT_TRUE(want_steps.count(hw)) << img.sizes() << " is not a bucket of the index";
    steps[hw] += 1;
    // The size conditioning follows the bucket: (orig h, orig w, h, w, crop top, crop left).
    EXPECT_EQ(batch.at("image_meta_size")[0][2].item<float>(), static_cast<float>(hw.first));
    EXPECT_EQ(batch.at("image_meta_size")[0][3].item<float>(), static_cast<float>(hw.second));
  }
  for (auto& [hw, n] : want_steps) EXPECT_EQ(steps[hw], 2 * n) << hw.first << "x" << hw.second;  // two epochs
  // The cursor's fingerprint is the data's, not the layout's: at batch 3 the repeats differ (24
  // entries), the index's 19 entries do not.
  auto other = test::load_graph_at(graph_yaml(kDir + "/index_multireso.json", 1, ", buckets: index", 3));
  const DataFingerprint a = g->state<DataCursor>("data", "cursor").data, b = other->state<DataCursor>("data", "cursor").data;
  EXPECT_TRUE(a == b) << a.str() << " vs " << b.str();
  EXPECT_EQ(a.items, 19);
}

TEST(ArrowImageTextNode, TwoRanksSplitTheGlobalBatchAndResumeIsExact) {
  REQUIRE_ARROW();
  const std::string idx = kDir + "/index_base.json";  // 19 entries: 4 steps of 4 an epoch
  auto r0 = test::load_graph_at(graph_yaml(idx, 3, ", flip: true"), 0, 2);
  auto r1 = test::load_graph_at(graph_yaml(idx, 3, ", flip: true"), 1, 2);
  auto whole = test::load_graph_at(graph_yaml(idx, 3, ", flip: true", 4));
  const auto s0 = test::run_and_probe(*r0), s1 = test::run_and_probe(*r1), sw = test::run_and_probe(*whole);
  for (int64_t s = 1; s <= 3; ++s)
    EXPECT_TRUE(torch::equal(torch::cat({s0.at(s).at("image"), s1.at(s).at("image")}), sw.at(s).at("image"))) << s;
  // Resume after step 5 (the second epoch), bit-identical to the run that did not stop.
  auto full = test::load_graph_at(graph_yaml(idx, 9, ", flip: true", 4));
  const auto want = test::run_and_probe(*full);
  auto resumed = test::load_graph_at(graph_yaml(idx, 9, ", flip: true", 4), 0, 1, /*first_step=*/6);
  resumed->state<DataCursor>("data", "cursor").load(full->state<DataCursor>("data", "cursor").tensors());
  resumed->state<DataCursor>("data", "cursor").batches = 5;
  const auto got = test::run_and_probe(*resumed);
  ASSERT_EQ(got.size(), 4u);
  for (int64_t s = 6; s <= 9; ++s) EXPECT_TRUE(torch::equal(got.at(s).at("image"), want.at(s).at("image"))) << "step " << s;
  // The cursor knows what it read: another index over the same files is other data.
  EXPECT_EQ(full->state<DataCursor>("data", "cursor").data.items, 19);
  auto other = test::load_graph_at(graph_yaml(kDir + "/index_plain.json", 9, "", 4), 0, 1, 6);
  EXPECT_THROW(other->state<DataCursor>("data", "cursor").load(full->state<DataCursor>("data", "cursor").tensors()), std::runtime_error);
}

TEST(ArrowImageTextNode, BadInputIsAnErrorNamingFileAndRow) {
  REQUIRE_ARROW();
  auto expect_error = [](const std::string& yaml, const std::string& text) {
    const std::string e = setup_error(yaml);
    EXPECT_NE(e.find(text), std::string::npos) << "want: " << text << "\ngot: " << e;
  };
  const std::string bad = kDir + "/bad/";
  expect_error(graph_yaml(bad + "truncated.arrow", 1), "truncated.arrow: not an Arrow IPC file, or cut short");
  expect_error(graph_yaml(bad + "wrong_image_type.arrow", 1), "wrong_image_type.arrow: column 'image' is int64; expected binary");
  expect_error(graph_yaml(bad + "wrong_width_type.arrow", 1),
               "wrong_width_type.arrow: column 'width', row 0: 'abc' is not a whole number");
  expect_error(graph_yaml(bad + "index_missing_file.json", 1), "index_missing_file.json: arrow_files[1] ");
  expect_error(graph_yaml(bad + "index_missing_file.json", 1), "missing/00000.arrow does not exist");
  expect_error(graph_yaml(bad + "index_cum_length_wrong.json", 1), "00000.arrow: holds 8 rows, but ");
  expect_error(graph_yaml(bad + "index_rows_out_of_range.json", 1), "indices[18] = 17 names no row");
  expect_error(graph_yaml(bad + "multireso_missing_npz.json", 1, ", buckets: index"), "missing.index.npz', which is not there");
  expect_error(graph_yaml(kDir + "/index_base.json", 1, ", caption_column: text_en"),
               "00000.arrow: no caption column 'text_en' (it has: text_zh, md5, width, height, image)");
  // Settings that do not fit the data are refused, not ignored.
  expect_error(graph_yaml(kDir + "/index_multireso.json", 1), "is a multi-resolution index (`idk multireso`: its rows are in 5 size buckets): set buckets: index");
  expect_error(graph_yaml(kDir + "/index_base.json", 1, ", buckets: index"), "buckets: index, but ");
  expect_error(graph_yaml(kDir + "/index_multireso.json", 1, ", buckets: index, bucket_sizes: [32x32]"),
               "bucket_sizes is given, but buckets is index");
  expect_error(graph_yaml(kDir + "/index_base.json", 1, ", split: val"), "an Index V2 or Arrow files are one split (train)");
  // An image that does not decode: an error naming file and row (on_bad: error), or skipped,
  // counted and replaced by the next good one (IndexKits would train on a white 256x256 image).
  auto strict = test::load_graph_at(graph_yaml(bad + "index_bad_image.json", 2, ", on_bad: error", 3));
  try {
    strict->run();
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("bad_image.arrow: row 1: "), std::string::npos) << e.what();
  }
  ArrowImageText d(bad + "index_bad_image.json", {"text_zh", OnBad::Skip, false, 1});
  Image img;
  EXPECT_EQ(d.load(1, {0, 1, 2}, &img), 2);
  EXPECT_EQ(d.bad_count(), 1);
  ASSERT_EQ(d.bad().size(), 1u);
  EXPECT_EQ(d.bad()[0].member, "row 1");
}

// The files stay open for the run: a soft open-files limit below them is raised toward the hard one.
TEST(ArrowImageText, AnOpenFilesLimitTooLowIsRaised) {
  REQUIRE_ARROW();
  rlimit before{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &before), 0);
  if (before.rlim_max != RLIM_INFINITY && before.rlim_max < 300) GTEST_SKIP() << "hard limit " << before.rlim_max;
  rlimit low = before;
  low.rlim_cur = 64;  // 2 files + 256 for the run are more
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  ArrowImageText d(kDir + "/index_base.json", {});
  rlimit now{};
  getrlimit(RLIMIT_NOFILE, &now);
  setrlimit(RLIMIT_NOFILE, &before);
  EXPECT_GE(now.rlim_cur, 258u);
  EXPECT_EQ(d.size(), 19);
}

// `flowrun prep arrow`: a folder of pairs becomes csv2arrow.py's files and an Index V2 over them,
// which the node reads back as the pairs, and pyarrow reads with csv2arrow's column types.
TEST(PrepArrow, PairsBecomeCsv2ArrowFilesAndAnIndexV2) {
  const std::string dir = test::temp_dir("parrow"), src = dir + "/src", out = dir + "/out";
  for (int i = 0; i < 7; ++i) {
    const Image img = resize(test::gradient(8, 8), 20 + 4 * i, 16 + 2 * i);
    const std::string stem = src + "/img" + std::to_string(i);
    if (i == 3) test::write_text(stem + ".jpg", encode_jpeg(img));
    else write_png(stem + ".png", img);
    test::write_text(stem + ".txt", i == 5 ? "  \n" : " 第" + std::to_string(i) + "张图 \n");  // 5: empty, skipped
  }
  test::write_text(src + "/broken.png", "not a png");
  test::write_text(src + "/broken.txt", "a caption");
  PrepArrowOptions o;
  o.dir = src, o.out = out, o.rows_per_file = 2, o.relative_paths = true, o.quiet = true;
  if (!arrow_available()) {
    EXPECT_THROW(prep_arrow(o), std::runtime_error);
    return;
  }
  const PrepArrowSummary s = prep_arrow(o);
  EXPECT_EQ(s.rows, 6);
  EXPECT_EQ(s.files, 3);
  EXPECT_EQ(s.empty_caption, 1);
  EXPECT_EQ(s.bad_image, 1);
  const IndexV2 idx = read_index_v2(out + "/index.json");
  EXPECT_EQ(idx.cum_length, (std::vector<int64_t>{2, 4, 6}));
  EXPECT_EQ(idx.indices, (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  ArrowImageText d(out + "/index.json", {});
  ASSERT_EQ(d.size(), 6);
  const int kept[6] = {0, 1, 2, 3, 4, 6};  // sorted by name: broken.png first, skipped
  for (int64_t i = 0; i < 6; ++i) {
    const int k = kept[i];
    EXPECT_EQ(d.caption(i), "第" + std::to_string(k) + "张图");
    EXPECT_EQ(d.image_size(i).w, 20 + 4 * k);
    EXPECT_EQ(d.image_size(i).h, 16 + 2 * k);
    const std::string file = src + "/img" + std::to_string(k) + (k == 3 ? ".jpg" : ".png");
    EXPECT_EQ(d.image_bytes(i), test::read_text(file));  // stored as they are
    ArrowFile f(d.place(i).first);
    EXPECT_EQ(f.bytes(f.column("md5"), std::stoll(d.place(i).second.substr(4))), md5_hex(test::read_text(file)));
  }
  // pyarrow sees csv2arrow.py's columns and types (where the build's Python has it).
  const std::string python = FLOWRUN_PYTHON;
  if (std::system(("'" + python + "' -c 'import pyarrow' > /dev/null 2>&1").c_str()) == 0) {
    const std::string cmd = "'" + python + "' -c \"import pyarrow as pa, sys; t = pa.ipc.open_file(pa.memory_map(sys.argv[1])).read_all(); "
                            "assert str(t.schema) == 'text_zh: string\\nmd5: string\\nwidth: int64\\nheight: int64\\nimage: binary', t.schema; "
                            "assert t.num_rows == 2\" '" + out + "/arrows/00000.arrow'";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  // A smaller second run, told to replace the first, leaves no file of the first behind.
  o.rows_per_file = 5000;
  o.replace = true;
  EXPECT_EQ(prep_arrow(o).files, 1);
  EXPECT_TRUE(std::filesystem::exists(out + "/arrows/00000.arrow"));
  EXPECT_FALSE(std::filesystem::exists(out + "/arrows/00001.arrow"));
}

// Issue 69: a second `prep arrow` into the same OUT_DIR replaced the Arrow files before it wrote
// the new index, so a run stopped between the two (or one with other images) left old and new
// files under one index. Now OUT_DIR is replaced whole or not at all, and only when asked.
TEST(PrepArrow, OutDirIsReplacedWholeOrNotAtAllAndOnlyWhenAsked) {
  if (!arrow_available()) GTEST_SKIP() << "built without Arrow";
  namespace fs = std::filesystem;
  const std::string dir = test::temp_dir("parrow_replace"), first = dir + "/first", second = dir + "/second", out = dir + "/out";
  for (int i = 0; i < 4; ++i) {
    write_png(first + "/a" + std::to_string(i) + ".png", resize(test::gradient(8, 8), 16, 16));
    test::write_text(first + "/a" + std::to_string(i) + ".txt", "first " + std::to_string(i));
    write_png(second + "/b" + std::to_string(i) + ".png", resize(test::gradient(8, 8), 24, 24));
    test::write_text(second + "/b" + std::to_string(i) + ".txt", "second " + std::to_string(i));
  }
  test::write_text(second + "/b9.png", "not a png");  // sorted last: --strict stops there,
  test::write_text(second + "/b9.txt", "broken");     // after three rows were written
  PrepArrowOptions o;
  o.dir = first, o.out = out, o.rows_per_file = 1, o.quiet = true;
  ASSERT_EQ(prep_arrow(o).files, 4);
  std::string index_before = test::read_text(out + "/index.json");
  auto listing = [&] {
    std::vector<std::string> names;
    for (const auto& e : fs::recursive_directory_iterator(dir)) names.push_back(fs::relative(e.path(), dir).string());
    std::sort(names.begin(), names.end());
    return names;
  };
  std::vector<std::string> before = listing();
  auto refused = [&](const std::string& want) {
    try {
      prep_arrow(o);
      ADD_FAILURE() << "no error, want: " << want;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
    EXPECT_EQ(test::read_text(out + "/index.json"), index_before);  // OUT_DIR as it was, nothing left beside it
    EXPECT_EQ(listing(), before);
  };
  o.dir = second, o.rows_per_file = 2;
  refused("holds an earlier output (index.json, arrows/): pass --replace 1");
  o.replace = true, o.strict = true;
  refused("b9.png: does not decode");  // stopped midway: files were written, into the staging folder only
  o.strict = false;
  const PrepArrowSummary s = prep_arrow(o);
  EXPECT_EQ(s.rows, 4);
  EXPECT_EQ(s.files, 2);
  ArrowImageText d(out + "/index.json", {});
  ASSERT_EQ(d.size(), 4);
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(d.caption(i), "second " + std::to_string(i));
  EXPECT_FALSE(fs::exists(out + "/arrows/00002.arrow"));  // none of the first run's
  const nlohmann::json summary = nlohmann::json::parse(test::read_text(out + "/prep_arrow.json"));
  ASSERT_EQ(summary["skipped"].size(), 1u);
  EXPECT_EQ(summary["skipped"][0]["file"], second + "/b9.png");
  // A folder holding what prep arrow did not write is never replaced.
  test::write_text(out + "/notes.md", "mine");
  index_before = test::read_text(out + "/index.json"), before = listing();
  refused("holds notes.md, which `prep arrow` did not write");
}

// Issue 69: one bad row never costs its neighbours, and nothing is silent. A caption in Latin-1
// bytes used to be written as is, and the whole Arrow file then failed to open; an unreadable
// image aborted the run; a CMYK JPEG was skipped while PIL converts it.
TEST(PrepArrow, BadRowsAreRepairedOrSkippedAloneAndCounted) {
  if (!arrow_available()) GTEST_SKIP() << "built without Arrow";
  namespace fs = std::filesystem;
  const std::string dir = test::temp_dir("parrow_bad"), src = dir + "/src", out = dir + "/out";
  const std::string images = std::string(FLOWRUN_SOURCE_DIR) + "/tests/fixtures/images/";
  for (int i = 0; i < 3; ++i) {
    write_png(src + "/p" + std::to_string(i) + ".png", test::gradient(12, 10));
    test::write_text(src + "/p" + std::to_string(i) + ".txt", "plain " + std::to_string(i));
  }
  test::write_text(src + "/p1.txt", "caf\xE9 cr\xE8me");  // Latin-1
  fs::copy_file(images + "cmyk.jpg", src + "/q_cmyk.jpg");
  test::write_text(src + "/q_cmyk.txt", "cmyk");
  fs::copy_file(images + "rgb16.png", src + "/q_rgb16.png");
  test::write_text(src + "/q_rgb16.txt", "sixteen bits");
  // An image that cannot be read (as root, permissions do not stop a read: a file whose read fails).
  const bool root = ::geteuid() == 0;
  if (root) fs::create_symlink("/proc/self/mem", src + "/r_unreadable.png");
  else {
    write_png(src + "/r_unreadable.png", test::gradient(4, 4));
    fs::permissions(src + "/r_unreadable.png", fs::perms::none);
  }
  test::write_text(src + "/r_unreadable.txt", "unreadable");
  PrepArrowOptions o;
  o.dir = src, o.out = out, o.quiet = true;
  const PrepArrowSummary s = prep_arrow(o);
  EXPECT_EQ(s.rows, 5);
  EXPECT_EQ(s.unreadable, 1);
  EXPECT_EQ(s.repaired_captions, 1);
  EXPECT_EQ(s.converted, (std::map<std::string, int64_t>{{"16-bit PNG", 1}, {"CMYK JPEG", 1}}));
  ArrowImageText d(out + "/index.json", {});  // the file opens: every row reads
  ASSERT_EQ(d.size(), 5);
  EXPECT_EQ(d.caption(1), "caf\uFFFD cr\uFFFDme");
  EXPECT_EQ(d.non_utf8_captions(), 0);  // repaired before it was written
  const nlohmann::json summary = nlohmann::json::parse(test::read_text(out + "/prep_arrow.json"));
  ASSERT_EQ(summary["skipped"].size(), 1u);
  EXPECT_NE(summary["skipped"][0]["file"].get<std::string>().find("r_unreadable.png"), std::string::npos);
  EXPECT_NE(summary["skipped"][0]["why"].get<std::string>().find("cannot be read"), std::string::npos);
  // --strict stops at it instead, naming it.
  o.strict = true, o.replace = true;
  try {
    prep_arrow(o);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("r_unreadable.png: cannot be read"), std::string::npos) << e.what();
  }
}

// Issue 69: an OUT_DIR whose name is not UTF-8 failed with a raw JSON type_error.316 after files
// were written. Now it is refused first, and nothing is written.
TEST(PrepArrow, ANameThatIsNotUtf8IsRefusedBeforeAnythingIsWritten) {
  if (!arrow_available()) GTEST_SKIP() << "built without Arrow";
  const std::string dir = test::temp_dir("parrow_name"), src = dir + "/src";
  write_png(src + "/a.png", test::gradient(8, 8));
  test::write_text(src + "/a.txt", "a");
  PrepArrowOptions o;
  o.dir = src, o.out = dir + "/out\xE9", o.quiet = true;
  try {
    prep_arrow(o);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("is not UTF-8"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("out\uFFFD"), std::string::npos) << e.what();
  }
  size_t entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) entries += e.path().filename() != "src";
  EXPECT_EQ(entries, 0u);
}

// Issue 69: a full disk was reported as something else and left .tmp files behind. A device too
// small for the images is said as such, with the bytes needed and free, before anything is
// written (a tmpfs of a few pages; root only: mount).
TEST(PrepArrow, AFullDiskIsSaidAsSuchBeforeAnythingIsWritten) {
  if (!arrow_available()) GTEST_SKIP() << "built without Arrow";
  if (::geteuid() != 0) GTEST_SKIP() << "mounting a small tmpfs needs root";
  const std::string dir = test::temp_dir("parrow_full"), src = dir + "/src", small = dir + "/small";
  uint64_t images = 0;
  for (int i = 0; i < 12; ++i) {
    const std::string stem = src + "/img" + std::to_string(i);
    write_png(stem + ".png", resize(test::gradient(8, 8), 96 + i, 96));
    test::write_text(stem + ".txt", "a caption");
    images += std::filesystem::file_size(stem + ".png");
  }
  std::filesystem::create_directories(small);
  const std::string size = "size=" + std::to_string(std::max<uint64_t>(4096, images / 2 / 4096 * 4096));
  if (::mount("tmpfs", small.c_str(), "tmpfs", 0, size.c_str()) != 0) GTEST_SKIP() << "cannot mount a tmpfs here";
  struct Unmount {
    std::string at;
    ~Unmount() { ::umount(at.c_str()); }
  } unmount{small};
  PrepArrowOptions o;
  o.dir = src, o.out = small + "/out", o.quiet = true;
  try {
    prep_arrow(o);
    ADD_FAILURE() << "no error for " << images << " bytes of images on a tmpfs of " << size;
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("no space left on the device holding " + small + ": the output needs ~"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find(" are free"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(std::filesystem::is_empty(small)) << "something was written";
}

// Issue 69: Arrow files written elsewhere (csv2arrow.py) may hold a caption that is not UTF-8:
// the file opens, that row reads repaired, setup counts it; empty captions are counted and
// warned about, and min_caption_chars leaves them out.
TEST(ArrowImageText, CaptionsNotUtf8OrEmptyCostOnlyTheirRowsAndAreCounted) {
  REQUIRE_ARROW();
  const std::string dir = test::temp_dir("arrow_captions");
  const std::string png = encode_png(test::gradient(8, 8));
  std::vector<ArrowColumn> cols = {{"text_zh", ArrowKind::string, {"good", "caf\xE9", "   ", "ok"}, {}},
                                   {"image", ArrowKind::binary, {png, png, png, png}, {}}};
  write_arrow_file(dir + "/00000.arrow", cols);  // Arrow's builder stores the bytes as given
  ArrowImageText::Options opt;
  opt.log = false;
  ArrowImageText d(dir + "/00000.arrow", opt);
  ASSERT_EQ(d.size(), 4);
  EXPECT_EQ(d.caption(1), "caf\uFFFD");
  EXPECT_EQ(d.caption(3), "ok");
  EXPECT_EQ(d.non_utf8_captions(), 1);
  EXPECT_EQ(d.empty_captions(), 1);
  opt.min_caption_chars = 3;  // "caf\uFFFD" has 4
  ArrowImageText kept(dir + "/00000.arrow", opt);
  EXPECT_EQ(kept.size(), 2);  // "good", "caf\uFFFD"
  EXPECT_EQ(kept.short_captions(), 2);
  EXPECT_EQ(kept.empty_captions(), 0);
}

// Issue 69: run.resume=auto did not notice an Arrow file changed in place at equal size (the
// fingerprint was names, rows and bytes). The cursor's fingerprint now carries a hash of sampled
// content: a copy of the data elsewhere (new mtimes and inodes) resumes, a change in place is
// refused naming it; checkpoints written before the content hash are compared without it.
TEST(ArrowImageText, AFileChangedInPlaceAtEqualSizeIsNoticedAtResume) {
  REQUIRE_ARROW();
  namespace fs = std::filesystem;
  const std::string dir = test::temp_dir("arrow_inplace"), src = dir + "/src";
  for (int i = 0; i < 3; ++i) {
    write_png(src + "/a" + std::to_string(i) + ".png", resize(test::gradient(8, 8), 16 + i, 16));
    test::write_text(src + "/a" + std::to_string(i) + ".txt", "caption " + std::to_string(i));
  }
  PrepArrowOptions o;
  o.dir = src, o.out = dir + "/out", o.relative_paths = true, o.quiet = true;
  prep_arrow(o);
  auto print = [](const std::string& index) {
    ArrowImageText d(index, {});
    return DataFingerprint{d.entries(), static_cast<int64_t>(d.files().size()), static_cast<int64_t>(d.content_hash()),
                           static_cast<int64_t>(d.content_sample())};
  };
  const DataFingerprint before = print(dir + "/out/index.json");
  fs::copy(dir + "/out", dir + "/copy", fs::copy_options::recursive);  // elsewhere: new inodes and mtimes
  const DataFingerprint copied = print(dir + "/copy/index.json");
  EXPECT_EQ(copied.content, before.content);
  EXPECT_TRUE(copied == before);
  {  // one byte of an image changed in place: same names, rows and size
    const std::string file = dir + "/out/arrows/00000.arrow";
    std::string bytes = test::read_text(file);
    const size_t at = bytes.find("IDAT");
    ASSERT_NE(at, std::string::npos);
    bytes[at + 8] ^= 0x5A;
    test::write_text(file, bytes);
  }
  const DataFingerprint after = print(dir + "/out/index.json");
  EXPECT_EQ(after.hash, before.hash);  // what the fingerprint held before this issue: blind to it
  EXPECT_NE(after.content, before.content);
  DataCursor saved;
  saved.data = before, saved.batches = 4;
  DataCursor now;
  now.data = after;
  try {
    now.load(saved.tensors());
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("the same names, rows and sizes: a file was changed in place"), std::string::npos) << e.what();
  }
  DataCursor older;  // a checkpoint from before the content hash: three values, compared without it
  older.data = after;
  older.load({{"batches", torch::tensor(int64_t{4})},
              {"data", torch::tensor({before.items, before.files, before.hash}, torch::kInt64)}});
  EXPECT_EQ(older.batches, 4);
}

}  // namespace
}  // namespace flowrun
