// image_text_shards and the pieces under it: images as tensors, `flowrun prep images` and
// `flowrun prep shapes`, bad-sample handling, the training order (ranks, seeds, buckets, resume)
// and the node in a graph. (image_io and tar themselves: tests/formats.)
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <numeric>
#include <set>

#include "data/image_tensor.hpp"
#include "data/cursor.hpp"
#include "formats/image_io.hpp"
#include "data/image_text_shards.hpp"
#include "prep/prep.hpp"
#include "prep/prep_images.hpp"
#include "data/shapes.hpp"
#include "formats/tar.hpp"
#include "data_test_helpers.hpp"
#include "node_test_helpers.hpp"

namespace flowrun {
namespace {

namespace fs = std::filesystem;
using test::corrupt_body_png;
using test::gradient;

std::string png_of(const Image& img) { return encode_png(img); }

// ---- image tensors (image_io itself: tests/formats/image_io_test.cpp) ---------------------

TEST(ImageIo, ImagesAsTensorsAndGrids) {
  const Image img = gradient(9, 6);
  // [-1, 1] float CHW and back; a grid of tiles.
  const torch::Tensor t = image_to_tensor(img);
  EXPECT_EQ(t.sizes(), (std::vector<int64_t>{3, 6, 9}));
  EXPECT_GE(t.min().item<float>(), -1.f);
  EXPECT_LE(t.max().item<float>(), 1.f);
  EXPECT_EQ(tensor_to_image(t).px, img.px);
  const Image grid = image_grid(torch::stack({t, t, t}), 2, 1);
  EXPECT_EQ(grid.w, 2 * 9 + 3);
  EXPECT_EQ(grid.h, 2 * 6 + 3);
  EXPECT_EQ(grid.at(1 + 9 + 1 + 4, 1 + 2)[0], img.at(4, 2)[0]);
}

// ---- shapes --------------------------------------------------------------------------------

TEST(Shapes, DeterministicAndCaptionsMatchWhatIsDrawn) {
  std::set<std::string> colors_seen;
  for (const std::string set : {"base", "lora"})
    for (int64_t i = 0; i < 60; ++i) {
      const ShapeSpec s = shape_spec(5, set, i);
      EXPECT_EQ(shape_caption(s), shape_caption(shape_spec(5, set, i)));
      const Image img = render_shape(s, 32);
      EXPECT_EQ(img.px, render_shape(shape_spec(5, set, i), 32).px);
      // The caption's color at the shape's centre, the background's in a far corner.
      double cx, cy, r;
      shape_geometry(s, 32, &cx, &cy, &r);
      const std::string cap = shape_caption(s);
      const ShapeColor& fg = shape_colors()[static_cast<size_t>(s.color)];
      const ShapeColor& bg = shape_colors()[static_cast<size_t>(s.background)];
      EXPECT_NE(cap.find(" " + fg.name + " " + s.kind + " "), std::string::npos) << cap;
      EXPECT_NE(cap.find("on a " + bg.name + " background"), std::string::npos) << cap;
      EXPECT_NE(cap.find(s.large ? "a large " : "a small "), std::string::npos) << cap;
      const uint8_t* c = img.at(static_cast<int>(cx), static_cast<int>(cy));
      for (int k = 0; k < 3; ++k) EXPECT_EQ(c[k], fg.rgb[k]) << cap;
      const int fx = s.position % 3 == 0 ? 31 : 0, fy = s.position / 3 == 0 ? 31 : 0;
      for (int k = 0; k < 3; ++k) EXPECT_EQ(img.at(fx, fy)[k], bg.rgb[k]) << cap;
      // Position words: the centre lies in the named third of the image.
      const std::string& pos = shape_positions()[static_cast<size_t>(s.position)];
      EXPECT_EQ(pos.find("left") != std::string::npos, cx < 32 / 3.0) << cap;
      EXPECT_EQ(pos.find("top") != std::string::npos, cy < 32 / 3.0) << cap;
      // base never says purple; lora always does.
      EXPECT_EQ(cap.find("purple") != std::string::npos, set == "lora") << cap;
      if (set == "lora") EXPECT_EQ(fg.name, "purple");
      colors_seen.insert(fg.name);
    }
  EXPECT_GE(colors_seen.size(), 6u);
  // all: every color, purple included, and never the shape's color as its background. base and
  // lora images are unchanged by its addition (their first captions, recorded before it).
  std::set<std::string> all_colors;
  for (int64_t i = 0; i < 200; ++i) {
    const ShapeSpec s = shape_spec(5, "all", i);
    EXPECT_NE(s.color, s.background);
    EXPECT_NE(shape_colors()[static_cast<size_t>(s.background)].name, "purple");
    all_colors.insert(shape_colors()[static_cast<size_t>(s.color)].name);
  }
  EXPECT_EQ(all_colors.size(), shape_colors().size());
  EXPECT_EQ(shape_caption(shape_spec(1, "base", 0)), "a small blue circle at the bottom left on a yellow background");
  EXPECT_EQ(shape_caption(shape_spec(1, "lora", 0)), "a small purple square at the top right on a black background");
  EXPECT_NE(shape_caption(shape_spec(5, "base", 0)) + shape_caption(shape_spec(5, "base", 1)),
            shape_caption(shape_spec(6, "base", 0)) + shape_caption(shape_spec(6, "base", 1)));
  EXPECT_THROW(shape_spec(1, "other", 0), std::invalid_argument);
}

TEST(Shapes, WritesPngsCaptionsAndAVocabCoveringBothSets) {
  const std::string dir = test::temp_dir("shapes");
  ASSERT_EQ(prep_command({"shapes", dir + "/a", "--count", "12", "--size", "16", "--seed", "3"}), 0);
  ASSERT_EQ(prep_command({"shapes", dir + "/b", "--count=12", "--size=16", "--seed=3"}), 0);
  ASSERT_EQ(prep_command({"shapes", dir + "/l", "--count", "4", "--size", "16", "--set", "lora"}), 0);
  EXPECT_EQ(prep_command({"shapes", dir + "/x", "--set", "nope"}), 2);
  EXPECT_EQ(prep_command({"shapes"}), 2);
  for (int i = 0; i < 12; ++i) {
    char stem[16];
    std::snprintf(stem, sizeof stem, "/%06d", i);
    EXPECT_EQ(test::read_text(dir + "/a" + stem + ".png"), test::read_text(dir + "/b" + stem + ".png"));
    EXPECT_EQ(test::read_text(dir + "/a" + stem + ".txt"), shape_caption(shape_spec(3, "base", i)) + "\n");
    EXPECT_EQ(decode_image(test::read_text(dir + "/a" + stem + ".png"), stem).w, 16);
  }
  EXPECT_FALSE(fs::exists(dir + "/a/000012.png"));
  const std::string vocab = test::read_text(dir + "/a/vocab.txt");
  EXPECT_EQ(vocab, test::read_text(dir + "/l/vocab.txt"));
  EXPECT_EQ(vocab.rfind("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n", 0), 0u);
  std::set<std::string> tokens;
  std::istringstream in(vocab);
  for (std::string t; std::getline(in, t);) EXPECT_TRUE(tokens.insert(t).second) << "twice: " << t;
  for (const std::string set : {"base", "lora"})
    for (int i = 0; i < 40; ++i) {
      std::istringstream words(shape_caption(shape_spec(9, set, i)));
      for (std::string w; words >> w;) EXPECT_TRUE(tokens.count(w)) << w;
    }
  EXPECT_TRUE(tokens.count("purple"));
  EXPECT_TRUE(tokens.count("##z"));
}

// ---- prep images ---------------------------------------------------------------------------

TEST(PrepImages, PacksPairsIntoTrainAndValShards) {
  const std::string src = test::temp_dir("pimg"), out = test::temp_dir("pimg_out") + "/set/shapes";
  for (int i = 0; i < 6; ++i) {
    const ShapeSpec s = shape_spec(1, "base", i);
    write_png(src + "/img" + std::to_string(i) + ".png", render_shape(s, 16));
    test::write_text(src + "/img" + std::to_string(i) + ".txt", "  " + shape_caption(s) + "\n");
  }
  test::write_text(src + "/photo.v2.JPG", encode_jpeg(gradient(20, 12)));
  test::write_text(src + "/photo.v2.txt", "a photo");
  write_png(src + "/nocap.png", gradient(8, 8));                  // no caption: skipped
  test::write_text(src + "/broken.png", "not a png at all");      // does not decode: skipped
  test::write_text(src + "/broken.txt", "a broken image");
  test::write_text(src + "/orphan.txt", "a caption without image");
  test::write_text(src + "/.hidden.png", "x");
  PrepImagesOptions opt;
  opt.dir = src, opt.out = out, opt.shard_size = 2, opt.val_fraction = 0.3, opt.quiet = true;
  const PrepImagesSummary s = prep_images(opt);
  EXPECT_EQ(s.samples[0] + s.samples[1], 7);
  // round(0.3 * 8 pairs) = 2 drawn for val before decoding (broken.png may be one of them).
  EXPECT_GE(s.samples[1], 1);
  EXPECT_LE(s.samples[1], 2);
  EXPECT_EQ(s.no_caption, 1);
  EXPECT_EQ(s.bad_image, 1);
  EXPECT_EQ(s.orphan_captions, 1);
  EXPECT_EQ(s.shards[0], (s.samples[0] + 1) / 2);
  EXPECT_TRUE(fs::exists(out + ".train-000000.tar"));
  EXPECT_TRUE(fs::exists(out + ".val-000000.tar"));
  const nlohmann::json j = nlohmann::json::parse(test::read_text(out + ".json"));
  EXPECT_EQ(j["samples"], 7);
  EXPECT_EQ(j["skipped"]["no_caption"], 1);
  EXPECT_EQ(j["skipped"]["bad_image"], 1);
  // Every sample is back, in name order within a split, with its caption trimmed.
  std::map<std::string, std::string> captions;
  std::vector<std::string> keys;
  for (const char* split : {"train", "val"})
    for (const std::string& path : ImageTextShards::shard_paths(out, split)) {
      TarFile f(path);
      for (const TarMember& m : f.index().members) {
        if (tar_ext(m.name) == "txt") captions[tar_key(m.name)] = f.read(m), keys.push_back(tar_key(m.name));
        else EXPECT_TRUE(tar_ext(m.name) == "png" || tar_ext(m.name) == "jpg") << m.name;
      }
    }
  EXPECT_EQ(captions.size(), 7u);
  EXPECT_EQ(captions.at("img3"), shape_caption(shape_spec(1, "base", 3)));
  EXPECT_EQ(captions.at("photo_v2"), "a photo");
  // The node's reader sees them all.
  ImageTextShards train(out, "train", OnBad::Error, false), val(out, "val", OnBad::Error, false);
  EXPECT_EQ(train.size() + val.size(), 7);
  // Re-running with bigger shards removes the stale ones.
  opt.shard_size = 100;
  prep_images(opt);
  EXPECT_EQ(ImageTextShards::shard_paths(out, "train").size(), 1u);
  // The command line.
  EXPECT_EQ(prep_command({"images", src, out + "2", "--shard-size", "3", "--val-fraction", "0"}), 0);
  EXPECT_FALSE(fs::exists(out + "2.val-000000.tar"));
  EXPECT_EQ(prep_command({"images", src}), 2);
  EXPECT_EQ(prep_command({"images", src + "/nope", out}), 2);
}

// ---- bad samples ---------------------------------------------------------------------------

// A shard of: good 0, 1; corrupt header (not an image); good 2; missing caption; corrupt
// body (found only when decoded); good 3; and a last member cut short.
std::string bad_shard() {
  const std::string prefix = test::temp_dir("bad") + "/d";
  const std::string path = prefix + ".train-000000.tar";
  {
    TarWriter w(path);
    auto good = [&](const std::string& key, int i) {
      w.add(key + ".png", png_of(render_shape(shape_spec(1, "base", i), 16)));
      w.add(key + ".txt", "good " + std::to_string(i));
    };
    good("k0", 0);
    good("k1", 1);
    w.add("k2.png", "garbage, not a png");
    w.add("k2.txt", "bad header");
    good("k3", 2);
    w.add("k4.png", png_of(gradient(16, 16)));  // no k4.txt
    w.add("k5.png", corrupt_body_png(gradient(16, 16)));
    w.add("k5.txt", "bad body");
    good("k6", 3);
    w.add("k7.png", png_of(gradient(64, 64)));
    w.finish();
  }
  const TarMember last = index_tar(path).members.back();  // k7.png: cut in the middle of its data
  fs::resize_file(path, last.offset + last.size / 2);
  return prefix;
}

TEST(ImageTextShards, BadSamplesAreSkippedCountedAndNamed) {
  const std::string p = bad_shard();
  ImageTextShards d(p, "train", OnBad::Skip, false);
  // Setup finds: k2 (header), k4 (no caption), k7 (truncated). k5 decodes badly later.
  EXPECT_EQ(d.size(), 5);
  EXPECT_EQ(d.bad_count(), 3);
  std::set<std::string> members;
  for (const BadSample& b : d.bad()) {
    members.insert(b.member);
    EXPECT_NE(b.shard.find(".train-000000.tar"), std::string::npos);
  }
  EXPECT_EQ(members, (std::set<std::string>{"k2.png", "k4.png", "k7.png"}));
  std::vector<std::string> keys;
  for (int64_t i = 0; i < d.size(); ++i) keys.push_back(d.sample(i).key);
  EXPECT_EQ(keys, (std::vector<std::string>{"k0", "k1", "k3", "k5", "k6"}));
  // Decoding k5 fails: it is replaced by the next good sample (k6), counted once.
  const std::vector<int64_t> pool = {0, 1, 2, 3, 4};
  std::vector<std::string> caps;
  const TensorMap b = load_image_batch(d, {3, 0, 3}, pool, 16, 16, {}, &caps);
  EXPECT_EQ(caps, (std::vector<std::string>{"good 3", "good 0", "good 3"}));
  EXPECT_EQ(b.at("image").sizes(), (std::vector<int64_t>{3, 3, 16, 16}));
  EXPECT_EQ(d.bad_count(), 4);
  load_image_batch(d, {3}, pool, 16, 16, {}, nullptr);
  EXPECT_EQ(d.bad_count(), 4);
  EXPECT_EQ(d.bad().back().member, "k5.png");
}

// HunyuanDiT's size conditioning: each row's original size, the size fed to the model and the
// top-left corner of the centre cut in the scaled image (what resize_center_crop cuts out).
TEST(ImageTextShards, BatchesCarryOriginalSizeCropAndStyle) {
  const std::string prefix = test::temp_dir("meta") + "/d";
  {
    TarWriter w(prefix + ".train-000000.tar");
    w.add("wide.png", png_of(gradient(20, 12)));  // 20 wide, 12 high
    w.add("wide.txt", "wide");
    w.add("tall.png", png_of(gradient(10, 30)));
    w.add("tall.txt", "tall");
    w.add("square.png", png_of(gradient(8, 8)));
    w.add("square.txt", "square");
    w.finish();
  }
  ImageTextShards d(prefix, "train", OnBad::Error, false);
  const TensorMap b = load_image_batch(d, {0, 1, 2}, {0, 1, 2}, 8, 8, {}, nullptr);
  // wide: scaled by 8/12 to 13 x 8, cut at x = (13 - 8) / 2 = 2; tall: by 8/10 to 8 x 24, cut
  // at y = 8; square: as it is.
  const torch::Tensor want = torch::tensor({12.f, 20.f, 8.f, 8.f, 0.f, 2.f,  //
                                            30.f, 10.f, 8.f, 8.f, 8.f, 0.f,  //
                                            8.f, 8.f, 8.f, 8.f, 0.f, 0.f})
                                 .view({3, 6});
  EXPECT_TRUE(torch::equal(b.at("image_meta_size"), want)) << b.at("image_meta_size");
  EXPECT_TRUE(torch::equal(b.at("style"), torch::zeros({3}, torch::kLong)));
  // The crop box is resize_center_crop's: cutting the scaled image there gives the batch's pixels.
  const CenterCrop c = center_crop_box(20, 12, 8, 8);
  EXPECT_TRUE(torch::equal(image_to_tensor(crop(resize(gradient(20, 12), c.rw, c.rh), c.left, c.top, 8, 8)), b.at("image")[0]));
}

TEST(ImageTextShards, OnBadErrorThrowsNamingShardAndMember) {
  const std::string p = bad_shard();
  try {
    ImageTextShards d(p, "train", OnBad::Error, false);
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("d.train-000000.tar"), std::string::npos) << m;
    EXPECT_NE(m.find("k2.png"), std::string::npos) << m;
  }
  // A shard whose only problem is a corrupt body fails when that sample is decoded.
  const std::string q = test::temp_dir("bad2") + "/e";
  {
    TarWriter w(q + ".train-000000.tar");
    w.add("a.png", png_of(gradient(8, 8)));
    w.add("a.txt", "fine");
    w.add("b.png", corrupt_body_png(gradient(16, 16)));
    w.add("b.txt", "corrupt");
    w.finish();
  }
  ImageTextShards d(q, "train", OnBad::Error, false);
  ASSERT_EQ(d.size(), 2);
  try {
    load_image_batch(d, {1}, {0, 1}, 8, 8, {}, nullptr);
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("e.train-000000.tar: b.png"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ImageTextShards(q, "val", OnBad::Skip, false), std::runtime_error);  // no val shards
}

// ---- order ---------------------------------------------------------------------------------

std::set<int64_t> as_set(const std::vector<int64_t>& v) { return {v.begin(), v.end()}; }

TEST(ImageTextSampler, RanksAreDisjointAndCoverTheGlobalBatchSameSeedSameOrder) {
  ImageTextSampler per_rank(std::vector<int>(50, 0), 1, 3, 7), whole(std::vector<int>(50, 0), 1, 6, 7), other(std::vector<int>(50, 0), 1, 3, 8);
  ASSERT_EQ(per_rank.steps_per_epoch(2), 8);
  std::set<int64_t> epoch;
  for (int64_t step : {1, 2, 5, 8, 9, 17, 30}) {
    const auto r0 = per_rank.for_step(step, 0, 2).second, r1 = per_rank.for_step(step, 1, 2).second;
    std::vector<int64_t> both = r0;
    both.insert(both.end(), r1.begin(), r1.end());
    EXPECT_EQ(as_set(both).size(), 6u) << "step " << step << ": a sample on both ranks";
    EXPECT_EQ(both, whole.for_step(step, 0, 1).second) << "step " << step;
    EXPECT_EQ(r0, ImageTextSampler(std::vector<int>(50, 0), 1, 3, 7).for_step(step, 0, 2).second);
  }
  for (int64_t step = 1; step <= 8; ++step)
    for (int r = 0; r < 2; ++r)
      for (int64_t i : per_rank.for_step(step, r, 2).second) EXPECT_TRUE(epoch.insert(i).second);
  EXPECT_EQ(epoch.size(), 48u);
  EXPECT_NE(per_rank.for_step(1, 0, 2).second, other.for_step(1, 0, 2).second);
  EXPECT_NE(per_rank.for_step(1, 0, 2).second, per_rank.for_step(9, 0, 2).second);  // a new epoch, a new order
  // Flips: about half, a function of (seed, step, row).
  int flips = 0;
  for (int64_t row = 0; row < 400; ++row) flips += per_rank.flip(3, row);
  EXPECT_GT(flips, 150);
  EXPECT_LT(flips, 250);
  EXPECT_THROW(ImageTextSampler(std::vector<int>(5, 0), 1, 3, 7).steps_per_epoch(2), std::runtime_error);
}

TEST(ImageTextSampler, EveryBatchHoldsOneBucket) {
  std::vector<int> bucket_of;
  for (int i = 0; i < 90; ++i) bucket_of.push_back(i % 3 == 0 ? 1 : i % 7 == 0 ? 2 : 0);
  ImageTextSampler s(bucket_of, 3, 4, 1);
  const int64_t spe = s.steps_per_epoch(1);
  EXPECT_EQ(spe, 13 + 7 + 2);  // bucket 0: 52 samples, 1: 30, 2: 8
  std::set<int> buckets_seen;
  for (int64_t step = 1; step <= spe; ++step) {
    const auto [b, ids] = s.for_step(step, 0, 1);
    buckets_seen.insert(b);
    for (int64_t i : ids) EXPECT_EQ(bucket_of[static_cast<size_t>(i)], b);
  }
  EXPECT_EQ(buckets_seen.size(), 3u);
  // HunyuanDiT-style sizes: aligned to 16 (but the square), area ~ size^2, nearest aspect ratio.
  BucketSpec spec;
  spec.kind = BucketSpec::Kind::ratios;
  const auto bs = image_buckets(spec);
  ASSERT_EQ(bs.size(), 5u);
  for (const ImageBucket& b : bs) {
    EXPECT_EQ(b.w % 16, 0);
    EXPECT_EQ(b.h % 16, 0);
    EXPECT_NEAR(b.w * b.h, 256 * 256, 256 * 256 * 0.08);
  }
  EXPECT_EQ(bs[static_cast<size_t>(nearest_bucket(bs, 1920, 1080))].w, 336);
  EXPECT_EQ(bs[static_cast<size_t>(nearest_bucket(bs, 1000, 1010))].w, 256);
  EXPECT_EQ(bs[static_cast<size_t>(nearest_bucket(bs, 600, 800))].h, 288);
  spec.kind = BucketSpec::Kind::none;
  spec.size = 32;
  EXPECT_EQ(image_buckets(spec).size(), 1u);
}

std::string names(const std::vector<ImageBucket>& bs) {
  std::string out;
  for (const ImageBucket& b : bs) out += (out.empty() ? "" : " ") + std::to_string(b.w) + "x" + std::to_string(b.h);
  return out;
}

// buckets: step is the resolution group of Hunyuan's training code; the expected lists were
// printed by its calc_by_step (Python, base/step/align as given), and the nearest bucket by its
// get_target_size (argmin of |h/w - ratio|).
TEST(ImageBuckets, StepIsHunyuansResolutionGroup) {
  BucketSpec spec;
  spec.kind = BucketSpec::Kind::step;
  spec.size = 64, spec.step = 16, spec.align = 16;
  EXPECT_EQ(names(image_buckets(spec)), "128x32 112x32 96x32 80x48 64x64 48x80 32x96 32x112 32x128");
  spec.size = 96, spec.step = 20, spec.align = 8;
  EXPECT_EQ(names(image_buckets(spec)), "192x48 176x48 152x48 136x56 112x72 96x96 72x112 56x136 48x152 48x176 48x192");
  spec.size = 1024, spec.step = 64, spec.align = 16;
  const auto bs = image_buckets(spec);
  ASSERT_EQ(bs.size(), 33u);
  EXPECT_EQ(names({bs.front(), bs[12], bs[16], bs.back()}), "2048x512 1280x768 1024x1024 512x2048");
  auto nearest = [&](int w, int h) { return names({bs[static_cast<size_t>(nearest_bucket(bs, w, h, spec.kind))]}); };
  EXPECT_EQ(nearest(1920, 1080), "1280x768");
  EXPECT_EQ(nearest(1080, 1920), "768x1280");
  EXPECT_EQ(nearest(1000, 1010), "1024x1024");
  EXPECT_EQ(nearest(3000, 1000), "1536x512");
  EXPECT_EQ(nearest(640, 480), "1152x896");
}

// buckets: list takes the sizes as written (WIDTHxHEIGHT), duplicates dropped; what cannot make
// sizes is an error naming the setting.
TEST(ImageBuckets, ListsAndBadSettings) {
  BucketSpec spec;
  spec.kind = BucketSpec::Kind::list;
  for (const char* v : {"1024x1024", "1280x768", "768x1280", "1280x768"}) spec.sizes.push_back(BucketSpec::parse_size(v));
  EXPECT_EQ(names(image_buckets(spec)), "1024x1024 1280x768 768x1280");
  for (const char* bad : {"1280", "1280x", "x768", "1280x768px", "4x4", "axb"}) {
    try {
      BucketSpec::parse_size(bad);
      ADD_FAILURE() << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos) << e.what();
    }
  }
  auto error = [](BucketSpec s) {
    try {
      image_buckets(s);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  spec.sizes.clear();
  EXPECT_NE(error(spec).find("bucket_sizes is empty"), std::string::npos);
  spec.kind = BucketSpec::Kind::step;
  spec.size = 64, spec.step = 40, spec.align = 16;
  EXPECT_NE(error(spec).find("bucket_step 40"), std::string::npos);
  spec.step = 16, spec.align = 32;
  EXPECT_NE(error(spec).find("bucket_align 32"), std::string::npos);
  spec.size = 72, spec.align = 16;
  EXPECT_NE(error(spec).find("bucket_align 16"), std::string::npos);  // does not divide 72
  EXPECT_THROW(BucketSpec::parse_kind("true"), std::invalid_argument);
}

// ---- the node ------------------------------------------------------------------------------

// PREFIX.train with n shapes (size px) in shards of 7, and PREFIX.val with 5.
std::string shapes_shards(int n, int size = 16) {
  const std::string dir = test::temp_dir("its");
  ShapesOptions so;
  so.out_dir = dir + "/src", so.count = n, so.size = size, so.seed = 2;
  write_shapes(so);
  PrepImagesOptions po;
  po.dir = so.out_dir, po.out = dir + "/shapes", po.shard_size = 7, po.val_fraction = 5.0 / n, po.quiet = true;
  prep_images(po);
  return po.out;
}


std::string graph_yaml(const std::string& path, int steps, const std::string& extra = "", int batch = 4) {
  return "flowrun: 1\nrun: { steps: " + std::to_string(steps) + ", seed: 3, prefetch: 2 }\nnodes:\n" +
         "  data: { type: image_text_shards, with: { path: '" + path + "', size: 12, batch: " + std::to_string(batch) +
         extra + " } }\n" +
         "  probe: { type: t_batch_probe, in: { batch: data.batch } }\n";
}

TEST(ImageTextShardsNode, BatchesAreImagesInRangeFromTheSamplersOrder) {
  const std::string p = shapes_shards(30);  // 25 train: 6 steps per epoch
  auto g = test::load_graph_at(graph_yaml(p, 8, ", flip: true"));
  const auto seen = test::run_and_probe(*g);
  ASSERT_EQ(seen.size(), 8u);
  ImageTextShards d(p, "train", OnBad::Error, false);
  ASSERT_EQ(d.size(), 25);
  ImageTextSampler ref(std::vector<int>(25, 0), 1, 4, 3);
  std::vector<int64_t> pool(25);
  std::iota(pool.begin(), pool.end(), 0);
  int flipped = 0;
  for (const auto& [step, batch] : seen) {
    const torch::Tensor img = batch.at("image");
    ASSERT_EQ(img.sizes(), (std::vector<int64_t>{4, 3, 12, 12}));
    EXPECT_EQ(img.scalar_type(), torch::kFloat32);
    EXPECT_GE(img.min().item<float>(), -1.f);
    EXPECT_LE(img.max().item<float>(), 1.f);
    std::vector<char> flips(4);
    for (int j = 0; j < 4; ++j) flips[static_cast<size_t>(j)] = ref.flip(step, j), flipped += flips[static_cast<size_t>(j)];
    const TensorMap want = load_image_batch(d, ref.for_step(step, 0, 1).second, pool, 12, 12, flips, nullptr);
    EXPECT_TRUE(torch::equal(img, want.at("image"))) << "step " << step;
  }
  EXPECT_GT(flipped, 0);
  EXPECT_LT(flipped, 32);
  EXPECT_EQ(g->state<DataCursor>("data", "cursor").batches, 8);
  // The dataset state: val and train in file order, at size x size, with captions.
  auto& ds = dynamic_cast<ImageTextDataset&>(g->state<Dataset>("data", "dataset"));
  EXPECT_EQ(ds.splits(), (std::vector<std::string>{"train", "val"}));
  EXPECT_EQ(ds.num_batches("val", 2, 0, 1), 2);
  const torch::Tensor v = ds.batch("val", 1, 2, 0, 1).at("image");
  EXPECT_EQ(v.sizes(), (std::vector<int64_t>{2, 3, 12, 12}));
  const auto caps = ds.captions("val", 1, 2, 0, 1);
  ASSERT_EQ(caps.size(), 2u);
  EXPECT_EQ(caps[0].rfind("a ", 0), 0u);
  EXPECT_TRUE(torch::equal(v, ds.batch("val", 1, 2, 0, 1).at("image")));
}

TEST(ImageTextShardsNode, TwoRanksReadDisjointBatchesAndResumeIsExact) {
  const std::string p = shapes_shards(30);
  auto r0 = test::load_graph_at(graph_yaml(p, 3, ", seed: 11"), 0, 2);
  const auto seen0 = test::run_and_probe(*r0);
  auto r1 = test::load_graph_at(graph_yaml(p, 3, ", seed: 11"), 1, 2);
  const auto seen1 = test::run_and_probe(*r1);
  auto whole = test::load_graph_at(graph_yaml(p, 3, ", seed: 11", /*batch=*/8), 0, 1);
  const auto seen_whole = test::run_and_probe(*whole);
  for (int64_t s = 1; s <= 3; ++s)
    EXPECT_TRUE(torch::equal(torch::cat({seen0.at(s).at("image"), seen1.at(s).at("image")}), seen_whole.at(s).at("image"))) << s;
  // Resume after step 5, across the epoch end (6 steps per epoch).
  auto full = test::load_graph_at(graph_yaml(p, 9, ", flip: true"));
  const auto want = test::run_and_probe(*full);
  auto resumed = test::load_graph_at(graph_yaml(p, 9, ", flip: true"), 0, 1, /*first_step=*/6);
  resumed->state<DataCursor>("data", "cursor").batches = 5;
  const auto got = test::run_and_probe(*resumed);
  ASSERT_EQ(got.size(), 4u);
  for (int64_t s = 6; s <= 9; ++s) EXPECT_TRUE(torch::equal(got.at(s).at("image"), want.at(s).at("image"))) << "step " << s;
  auto bad = test::load_graph_at(graph_yaml(p, 9), 0, 1, /*first_step=*/6);
  bad->state<DataCursor>("data", "cursor").batches = 2;
  EXPECT_THROW(bad->run(), std::exception);
  // Issue 47: shards changed since the checkpoint (here the last one gone) were read on from the
  // old cursor; the cursor keeps what it read, and a resume over other data is refused.
  const auto saved = full->state<DataCursor>("data", "cursor").tensors();
  const auto paths = ImageTextShards::shard_paths(p, "train");
  std::filesystem::rename(paths.back(), p + ".elsewhere");
  auto changed = test::load_graph_at(graph_yaml(p, 12, ", flip: true"), 0, 1, /*first_step=*/10);
  try {
    changed->state<DataCursor>("data", "cursor").load(saved);
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("then 25 items in " + std::to_string(paths.size()) + " file(s)"), std::string::npos)
        << e.what();
  }
}

// Issue 47: settings that did nothing or escaped the size checks: bucket_sizes with buckets:
// step was ignored; a size or batch that cannot fit ended in torch's allocator text.
TEST(ImageTextShardsNode, SettingsThatCannotWorkAreRefusedAtSetup) {
  const std::string p = shapes_shards(10);
  auto error_of = [&](const std::string& extra, int size = 12) -> std::string {
    std::string yaml = graph_yaml(p, 2, extra);
    yaml.replace(yaml.find("size: 12"), 8, "size: " + std::to_string(size));
    try {
      test::load_graph_at(yaml);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "no error";
  };
  std::string e = error_of(", buckets: step, bucket_sizes: [16x16]");
  EXPECT_NE(e.find("bucket_sizes is given, but buckets is not list"), std::string::npos) << e;
  e = error_of("", 2000000);
  EXPECT_NE(e.find("node 'data' (image_text_shards): a batch (4 images of up to 4000000000000 pixels"), std::string::npos) << e;
}

TEST(ImageTextShardsNode, BucketsGiveOneSizePerBatch) {
  // Images of three shapes: 32x32, 48x27 (16:9) and 24x32 (3:4).
  const std::string dir = test::temp_dir("buck"), src = dir + "/src";
  for (int i = 0; i < 24; ++i) {
    const int w = i % 3 == 0 ? 32 : i % 3 == 1 ? 48 : 24, h = i % 3 == 0 ? 32 : i % 3 == 1 ? 27 : 32;
    write_png(src + "/" + std::to_string(100 + i) + ".png", resize(gradient(8, 8), w, h));
    test::write_text(src + "/" + std::to_string(100 + i) + ".txt", "image " + std::to_string(i));
  }
  PrepImagesOptions po;
  po.dir = src, po.out = dir + "/b", po.val_fraction = 0, po.quiet = true;
  prep_images(po);
  auto g = test::load_graph_at("flowrun: 1\nrun: { steps: 6, seed: 1 }\nnodes:\n  data: { type: image_text_shards, with: { path: '" + po.out +
                      "', size: 32, batch: 4, buckets: ratios } }\n  probe: { type: t_batch_probe, in: { batch: data.batch } }\n");
  const auto seen = test::run_and_probe(*g);
  std::set<std::vector<int64_t>> shapes;
  for (const auto& [step, batch] : seen) shapes.insert(batch.at("image").sizes().vec());
  // 32 -> buckets 32x32, 48x32 (16:9), 32x48 (9:16) (4:3 and 3:4 round to 32x32); 48x27 images
  // go to 48x32, 24x32 (3:4) ones to 32x48, the nearer ratio in log terms. 8 each: 2 steps each.
  EXPECT_EQ(shapes, (std::set<std::vector<int64_t>>{{4, 3, 32, 32}, {4, 3, 32, 48}, {4, 3, 48, 32}})) << "got " << shapes.size() << " shapes";
}

// A set of mixed sizes end to end: prep keeps each image's own size, and over an epoch every
// bucket of the list comes as batches of its size, each row's image_meta_size holding its
// original height and width, the bucket and the crop of the scaled image (scale to cover, centre
// crop), every image exactly once.
TEST(ImageTextShardsNode, MixedSizesEndToEnd) {
  // (w, h) and how many: 4 go to each bucket (64x64, 96x48, 48x96), two original sizes each.
  const std::vector<std::array<int, 3>> kinds = {{64, 64, 2}, {70, 66, 2}, {100, 50, 2}, {90, 40, 2}, {50, 100, 2}, {36, 80, 2}};
  const std::string dir = test::temp_dir("mixed"), src = dir + "/src";
  int n = 0;
  for (const auto& [w, h, count] : kinds)
    for (int k = 0; k < count; ++k, ++n) {
      write_png(src + "/" + std::to_string(100 + n) + ".png", resize(gradient(8, 8), w, h));
      test::write_text(src + "/" + std::to_string(100 + n) + ".txt", "image " + std::to_string(n));
    }
  PrepImagesOptions po;
  po.dir = src, po.out = dir + "/m", po.val_fraction = 0, po.quiet = true;
  prep_images(po);
  auto g = test::load_graph_at("flowrun: 1\nrun: { steps: 6, seed: 3 }\nnodes:\n  data: { type: image_text_shards, with: { path: '" +
                               po.out + "', batch: 2, buckets: list, bucket_sizes: [64x64, 96x48, 48x96] } }\n"
                               "  probe: { type: t_batch_probe, in: { batch: data.batch } }\n");
  const auto seen = test::run_and_probe(*g);
  ASSERT_EQ(seen.size(), 6u);  // 12 images, batch 2: one epoch
  std::map<std::pair<int, int>, int> originals;  // (w, h) -> rows seen
  std::set<std::pair<int64_t, int64_t>> sizes;
  for (const auto& [step, batch] : seen) {
    const torch::Tensor& image = batch.at("image");
    const int64_t H = image.size(2), W = image.size(3);
    sizes.insert({W, H});
    const torch::Tensor meta = batch.at("image_meta_size");
    for (int64_t r = 0; r < image.size(0); ++r) {
      const int oh = static_cast<int>(meta[r][0].item<float>()), ow = static_cast<int>(meta[r][1].item<float>());
      ++originals[{ow, oh}];
      // The bucket is the nearest in h/w of the three.
      const double ratio = static_cast<double>(oh) / ow;
      const std::vector<std::pair<int64_t, int64_t>> list = {{64, 64}, {96, 48}, {48, 96}};
      size_t best = 0;
      for (size_t b = 1; b < list.size(); ++b)
        if (std::abs(ratio - double(list[b].second) / list[b].first) < std::abs(ratio - double(list[best].second) / list[best].first)) best = b;
      EXPECT_EQ(std::make_pair(W, H), list[best]) << ow << "x" << oh;
      // Scaled to cover W x H, centre-cropped: the crop's top and left in the scaled image.
      const double s = std::max(double(W) / ow, double(H) / oh);
      const int64_t sw = std::max<int64_t>(W, std::lround(ow * s)), sh = std::max<int64_t>(H, std::lround(oh * s));
      EXPECT_EQ(meta[r][2].item<float>(), H);
      EXPECT_EQ(meta[r][3].item<float>(), W);
      EXPECT_EQ(meta[r][4].item<float>(), (sh - H) / 2) << ow << "x" << oh;
      EXPECT_EQ(meta[r][5].item<float>(), (sw - W) / 2) << ow << "x" << oh;
    }
  }
  EXPECT_EQ(sizes, (std::set<std::pair<int64_t, int64_t>>{{64, 64}, {96, 48}, {48, 96}}));
  std::map<std::pair<int, int>, int> want;
  for (const auto& [w, h, count] : kinds) want[{w, h}] = count;
  EXPECT_EQ(originals, want);
}

TEST(ImageTextShardsNode, MissingShardsAreAnErrorNamingThePrefix) {
  try {
    auto g = test::load_graph_at(graph_yaml(test::temp_dir("none") + "/nothing", 1));
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("nothing.train-*.tar"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace flowrun
