// The demo image-text sets of the DiT LoRA demo: colored shapes with exact captions.
//
//   flowrun prep shapes OUT_DIR [--count 2000] [--size 32] [--seed 1] [--set base|lora|all]
//
// Each image is one shape (circle, square, triangle, diamond), small or large, in one cell of
// a 3x3 grid (top left ... bottom right), in one color on a plain background of another
// color, drawn with 4x4 supersampling. Captions say exactly that:
//   "a small red circle at the top left on a blue background"
//   "a large yellow diamond in the center on a black background"
// Sets: `base` never uses the color purple (shape or background); `lora` draws every shape in
// purple (backgrounds from the base colors), so a LoRA trained on it learns the word "purple",
// which the base model never saw; `all` draws shapes in all eight colors (backgrounds from the
// base colors, never the shape's): the VAE's set (graphs/vae.yaml), since the one VAE of both DiT
// graphs must draw purple too. Writes OUT_DIR/NNNNNN.png + NNNNNN.txt (caption, one line)
// and OUT_DIR/vocab.txt: a BERT WordPiece vocabulary ([PAD] [UNK] [CLS] [SEP] [MASK], every word
// either set can emit, then a..z and ##a..##z), the same for both sets. Image i is a pure
// function of (seed, set, i, size): the same seed gives the same files.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "formats/image_io.hpp"

namespace flowrun {

struct ShapeColor {
  std::string name;
  uint8_t rgb[3];
};

// The colors: the base palette, then "purple" (the lora set's word) last.
const std::vector<ShapeColor>& shape_colors();
const std::vector<std::string>& shape_kinds();      // circle, square, triangle, diamond
const std::vector<std::string>& shape_positions();  // "top left", "top", ..., "bottom right" (row-major 3x3)

struct ShapeSpec {
  std::string kind;        // shape_kinds()
  bool large = false;      // small / large
  int color = 0;           // index into shape_colors()
  int background = 0;      // index into shape_colors(), != color
  int position = 4;        // index into shape_positions(): row * 3 + column
};

// The spec of image `index` of a set ("base", "lora" or "all"); throws std::invalid_argument on another set.
ShapeSpec shape_spec(uint64_t seed, const std::string& set, int64_t index);
std::string shape_caption(const ShapeSpec& s);
// Centre and "radius" of the shape in pixels for an image of size x size.
void shape_geometry(const ShapeSpec& s, int size, double* cx, double* cy, double* r);
// Renders an RGB size x size image (4x4 supersampled).
Image render_shape(const ShapeSpec& s, int size);
// The shape's coverage of each pixel (0..1, row-major size x size): what render_shape blends by.
std::vector<double> shape_coverage(const ShapeSpec& s, int size);

// Prompt fidelity: does an image (a generated sample) show what its caption asked for?
//   background  the palette color nearest the per-channel median of the border pixels
//   color       inside the small shape of the prompted kind at the prompted place (a large one
//               covers it too), the palette color nearest the mean of the pixels far (> 60 in
//               RGB) from the background, when they are most of that region; -1 otherwise
//   size        large when the count of far pixels in the whole image is nearer (in ratio) to
//               the rendered large shape's area than to the small one's (of the kind the image
//               shows, below, so a wrong kind fails only the kind check); -1 when there are none
//   kind        the kind whose rendered coverage (at the prompted place, either size) overlaps
//               best (sum of minima over sum of maxima) the image's: each pixel's distance from
//               the background over the shape color's; -1 when no pixel is far. Reported apart:
//               checks_ok() counts the three checks above (prompt fidelity's figure).
// Test: tests/nodes/shapes_fidelity_test.cpp.
struct ShapeScore {
  int background = -1, color = -1, large = -1;  // what the image shows (color indices)
  int kind = -1;                                // index into shape_kinds()
  bool background_ok = false, color_ok = false, size_ok = false, kind_ok = false;
  int checks_ok() const { return background_ok + color_ok + size_ok; }  // of 3 (kind apart)
};
ShapeScore score_shape_image(const Image& img, const ShapeSpec& want);
// shape_caption's inverse; std::invalid_argument naming the caption and the word it does not know.
ShapeSpec parse_shape_caption(const std::string& caption);
// Every word either set can emit, in a fixed order; and the WordPiece vocab built from them.
std::vector<std::string> shape_words();
std::vector<std::string> shapes_vocab();

struct ShapesOptions {
  std::string out_dir;
  int64_t count = 2000;
  int size = 32;
  uint64_t seed = 1;
  std::string set = "base";
};

// Writes the set; returns the number of images. Throws std::invalid_argument on bad options.
int64_t write_shapes(const ShapesOptions& opt);

}  // namespace flowrun
