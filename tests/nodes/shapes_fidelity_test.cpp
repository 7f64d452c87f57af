// Prompt fidelity on the shapes set (nodes/data/shapes.hpp): the scorer a sample evaluator will
// use. On images rendered from their own captions every check passes; each thing a sample can get
// wrong (background, shape color, place, size) fails its check and only its check.
#include <gtest/gtest.h>

#include "data/shapes.hpp"

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
  EXPECT_TRUE(sc.background_ok && sc.color_ok);
  EXPECT_FALSE(sc.size_ok);
  // An empty image: only its background can be right.
  drawn = want;
  drawn.color = drawn.background;
  sc = score_shape_image(render_shape(drawn, 32), want);
  EXPECT_EQ(sc.checks_ok(), 1);
  EXPECT_EQ(sc.large, -1);
  EXPECT_THROW(score_shape_image(Image(32, 16), want), std::invalid_argument);
}

}  // namespace
}  // namespace flowrun
