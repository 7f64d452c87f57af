// Prompt fidelity on the shapes set: the scorer (nodes/data/shapes.hpp) and the shapes_fidelity
// node over it (nodes/eval/shapes_fidelity.cpp). On images rendered from their own captions every
// check passes; each thing a sample can get wrong (background, shape color, place, size, kind)
// fails its check and only its check; the node tallies images per prompt and logs a figure per prompt and
// their mean. (Its samples from a sampler: sampler_test.cpp; in the demo graphs:
// graph_hydit_lora_test.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "data/image_tensor.hpp"
#include "data/shapes.hpp"
#include "data_test_helpers.hpp"
#include "eval/shapes_fidelity.hpp"
#include "node_test_helpers.hpp"

namespace flowrun {
namespace {

TEST(ShapesFidelity, CaptionsParseBackToTheirSpec) {
  for (const char* set : {"base", "lora"})
    for (int64_t i = 0; i < 300; ++i) {
      const ShapeSpec s = shape_spec(7, set, i);
      const ShapeSpec p = parse_shape_caption(shape_caption(s));
      EXPECT_EQ(p.kind, s.kind);
      EXPECT_EQ(p.large, s.large);
      EXPECT_EQ(p.color, s.color);
      EXPECT_EQ(p.background, s.background);
      EXPECT_EQ(p.position, s.position) << shape_caption(s);
    }
  for (const char* bad : {"a small red blob at the top on a blue background", "a huge red circle in the center on a blue background",
                          "a small red circle in the middle on a blue background", "red circle", ""}) {
    try {
      parse_shape_caption(bad);
      FAIL() << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("not a shapes caption"), std::string::npos) << e.what();
    }
  }
}

TEST(ShapesFidelity, RenderedCaptionsPassEveryCheck) {
  for (int size : {32, 64})
    for (const char* set : {"base", "lora"})
      for (int64_t i = 0; i < 200; ++i) {
        const ShapeSpec s = shape_spec(3, set, i);
        const ShapeScore sc = score_shape_image(render_shape(s, size), s);
        EXPECT_EQ(sc.checks_ok(), 3) << shape_caption(s) << " at " << size << " px: bg " << sc.background << " color "
                                     << sc.color << " large " << sc.large;
        EXPECT_TRUE(sc.kind_ok) << shape_caption(s) << " at " << size << " px: seen as kind " << sc.kind;
      }
}

TEST(ShapesFidelity, EachMistakeFailsItsOwnCheck) {
  ShapeSpec want;
  want.kind = "circle";
  want.large = false;
  want.color = 0;       // red
  want.background = 2;  // blue
  want.position = 0;    // top left
  ShapeSpec drawn = want;
  drawn.color = 7;  // purple instead of red
  ShapeScore sc = score_shape_image(render_shape(drawn, 32), want);
  EXPECT_TRUE(sc.background_ok && sc.size_ok);
  EXPECT_FALSE(sc.color_ok);
  EXPECT_EQ(sc.color, 7);
  drawn = want;
  drawn.background = 4;  // white
  sc = score_shape_image(render_shape(drawn, 32), want);
  EXPECT_FALSE(sc.background_ok);
  EXPECT_TRUE(sc.color_ok && sc.size_ok);
  drawn = want;
  drawn.position = 8;  // bottom right: nothing red at the top left
  sc = score_shape_image(render_shape(drawn, 32), want);
  EXPECT_TRUE(sc.background_ok && sc.size_ok);
  EXPECT_FALSE(sc.color_ok);
  EXPECT_EQ(sc.color, -1);
  drawn = want;
  drawn.large = true;
  sc = score_shape_image(render_shape(drawn, 32), want);
  EXPECT_TRUE(sc.background_ok && sc.color_ok && sc.kind_ok);
  EXPECT_FALSE(sc.size_ok);
  // Another kind at the same place and size: the kind check fails, and only it (fidelity's
  // three pass), for every pair of kinds, small and large.
  for (bool large : {false, true})
    for (const std::string& asked : shape_kinds())
      for (const std::string& shown : shape_kinds()) {
        if (asked == shown) continue;
        ShapeSpec w = want, d = want;
        w.large = d.large = large;
        w.kind = asked;
        d.kind = shown;
        sc = score_shape_image(render_shape(d, 32), w);
        EXPECT_FALSE(sc.kind_ok) << shown << " drawn, " << asked << " asked, large " << large;
        EXPECT_EQ(sc.kind >= 0 ? shape_kinds()[static_cast<size_t>(sc.kind)] : "", shown) << asked << ", large " << large;
        EXPECT_TRUE(sc.background_ok && sc.size_ok) << shown << " drawn, " << asked << " asked, large " << large;
      }
  // An empty image: only its background can be right.
  drawn = want;
  drawn.color = drawn.background;
  sc = score_shape_image(render_shape(drawn, 32), want);
  EXPECT_EQ(sc.checks_ok(), 1);
  EXPECT_EQ(sc.large, -1);
  EXPECT_THROW(score_shape_image(Image(32, 16), want), std::invalid_argument);
}

ShapeSpec spec(const std::string& caption) { return parse_shape_caption(caption); }

// Images [N, 3, S, S] in [-1, 1] rendered from specs.
torch::Tensor images_of(const std::vector<ShapeSpec>& specs, int size = 32) {
  std::vector<torch::Tensor> t;
  for (const auto& s : specs) t.push_back(image_to_tensor(render_shape(s, size)));
  return torch::stack(t);
}

// A prompt's figure is the share of the 3 checks per image its images passed; prompts come in
// the order they first appear, each counting only its own images.
TEST(ShapesFidelity, TalliesEachPromptsImagesInTheOrderPromptsFirstAppear) {
  const std::string red = "a small red circle at the top left on a blue background";
  const std::string green = "a large green square in the center on a black background";
  ShapeSpec wrong_color = spec(red);
  wrong_color.color = 7;  // purple: fails the color check only
  ShapeSpec wrong_size = spec(green);
  wrong_size.large = false;  // fails the size check only
  const torch::Tensor x = images_of({spec(green), spec(red), wrong_color, wrong_size, spec(red)});
  const std::vector<PromptTally> t = score_captioned_images(x, {green, red, red, green, red});
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].caption, green);
  EXPECT_EQ(t[0].samples, 2);
  EXPECT_EQ(t[0].background, 2);
  EXPECT_EQ(t[0].color, 2);
  EXPECT_EQ(t[0].size, 1);
  EXPECT_DOUBLE_EQ(t[0].percent(), 100.0 * 5 / 6);
  EXPECT_EQ(t[1].caption, red);
  EXPECT_EQ(t[1].samples, 3);
  EXPECT_EQ(t[1].color, 2);
  EXPECT_DOUBLE_EQ(t[1].percent(), 100.0 * 8 / 9);
  EXPECT_TRUE(std::isnan(PromptTally{}.percent()));
}

TEST(ShapesFidelity, RefusesWhatItCannotScoreNamingIt) {
  const std::string red = "a small red circle at the top left on a blue background";
  auto error = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const torch::Tensor x = images_of({spec(red), spec(red)});
  EXPECT_NE(error([&] { score_captioned_images(x, {red}); }).find("2 images but 1 captions"), std::string::npos);
  const std::string odd = error([&] { score_captioned_images(x, {red, "a cat on a mat"}); });
  EXPECT_NE(odd.find("a cat on a mat"), std::string::npos) << odd;
  EXPECT_NE(error([&] { score_captioned_images(x.narrow(1, 0, 1), {red, red}); }).find("[N, 3, H, W]"),
            std::string::npos);
}

// The node on the training images themselves, a data node's batch and captions: every check of
// every image passes, each distinct caption is one per_prompt/CAPTION field in metrics.jsonl.
TEST(ShapesFidelityNode, ScoresTheShapesSetsOwnImagesAtOneHundredPercent) {
  const std::string data = test::temp_dir("fidelity_node");
  test::make_shapes_set(data, "lora", 40, 32);
  test::RunResult r = test::run_graph_text(R"(
flowrun: 1
run: { steps: 3, log_every: 1 }
nodes:
  data: { type: image_text_shards, with: { path: )" + data + R"(/lora, size: 32, batch: 6 } }
  fid:  { type: shapes_fidelity, in: { images: data.batch, captions: data.captions } }
  log:  { type: metrics, in: { fidelity: fid.fidelity, background: fid.background, color: fid.color, size: fid.size,
                               kind: fid.kind, per_prompt: fid.per_prompt, per_prompt_color: fid.per_prompt_color } }
)");
  ASSERT_EQ(r.metrics.size(), 3u);
  for (const auto& j : r.metrics) {
    for (const char* k : {"fidelity", "background", "color", "size", "kind"})
      EXPECT_DOUBLE_EQ(j[k].get<double>(), 100.0) << k;
    int prompts = 0, colors = 0;
    for (const auto& [k, v] : j.items()) {
      if (k.rfind("per_prompt/a ", 0) == 0) {
        ++prompts;
        EXPECT_DOUBLE_EQ(v.get<double>(), 100.0) << k;
        EXPECT_NO_THROW(parse_shape_caption(k.substr(11))) << k;
      }
      if (k.rfind("per_prompt_color/a ", 0) == 0) {
        ++colors;
        EXPECT_DOUBLE_EQ(v.get<double>(), 100.0) << k;
      }
    }
    EXPECT_GE(prompts, 1);
    EXPECT_LE(prompts, 6);
    EXPECT_EQ(colors, prompts);
  }
}

}  // namespace
}  // namespace flowrun
