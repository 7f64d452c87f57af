// The shapes demo sets: see shapes.hpp.
#include "data/shapes.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

#include "common/seed.hpp"
#include "data/cli_args.hpp"

namespace flowrun {

namespace {

constexpr uint64_t kTagShapes = 0x7368617065ull;  // "shape"

// A SplitMix64 stream.
struct Rng {
  uint64_t state;
  uint64_t next() {
    state += 0x9E3779B97F4A7C15ull;
    return splitmix64(state);
  }
  int below(int n) { return static_cast<int>((static_cast<unsigned __int128>(next()) * static_cast<uint64_t>(n)) >> 64); }
};

int purple_index() { return static_cast<int>(shape_colors().size()) - 1; }

bool inside(const ShapeSpec& s, double cx, double cy, double r, double x, double y) {
  const double dx = x - cx, dy = y - cy;
  if (s.kind == "circle") return dx * dx + dy * dy <= r * r;
  if (s.kind == "square") return std::abs(dx) <= 0.85 * r && std::abs(dy) <= 0.85 * r;
  if (s.kind == "diamond") return std::abs(dx) + std::abs(dy) <= 1.15 * r;
  if (s.kind == "triangle") {
    // Apex up at (cx, cy - r), base from (cx - r, cy + 0.8 r) to (cx + r, cy + 0.8 r).
    if (dy > 0.8 * r || dy < -r) return false;
    const double half = r * (dy + r) / (1.8 * r);  // half-width grows from 0 at the apex to r at the base
    return std::abs(dx) <= half;
  }
  throw std::invalid_argument("unknown shape '" + s.kind + "'");
}

}  // namespace

const std::vector<ShapeColor>& shape_colors() {
  static const std::vector<ShapeColor> c = {
      {"red", {220, 40, 40}},     {"green", {40, 170, 60}},  {"blue", {40, 80, 220}},   {"yellow", {240, 220, 40}},
      {"white", {245, 245, 245}}, {"black", {15, 15, 15}},   {"gray", {128, 128, 128}}, {"purple", {140, 50, 170}},
  };
  return c;
}

const std::vector<std::string>& shape_kinds() {
  static const std::vector<std::string> k = {"circle", "square", "triangle", "diamond"};
  return k;
}

const std::vector<std::string>& shape_positions() {
  static const std::vector<std::string> p = {"top left", "top",         "top right", "left", "center",
                                             "right",    "bottom left", "bottom",    "bottom right"};
  return p;
}

ShapeSpec shape_spec(uint64_t seed, const std::string& set, int64_t index) {
  if (set != "base" && set != "lora") throw std::invalid_argument("unknown shapes set '" + set + "' (known: base, lora)");
  const bool lora = set == "lora";
  Rng rng{mix_seed({seed, kTagShapes, lora ? 1ull : 0ull, static_cast<uint64_t>(index)})};
  ShapeSpec s;
  const int base_colors = purple_index();  // colors 0 .. base_colors-1 never include purple
  s.kind = shape_kinds()[static_cast<size_t>(rng.below(static_cast<int>(shape_kinds().size())))];
  s.large = rng.below(2) == 1;
  s.position = rng.below(9);
  s.color = lora ? purple_index() : rng.below(base_colors);
  s.background = rng.below(lora ? base_colors : base_colors - 1);
  if (!lora && s.background >= s.color) ++s.background;  // any base color but the shape's
  return s;
}

std::string shape_caption(const ShapeSpec& s) {
  const std::string& pos = shape_positions()[static_cast<size_t>(s.position)];
  const std::string where = pos == "center" ? "in the center" : (pos == "left" || pos == "right") ? "on the " + pos : "at the " + pos;
  return std::string("a ") + (s.large ? "large " : "small ") + shape_colors()[static_cast<size_t>(s.color)].name + " " + s.kind + " " +
         where + " on a " + shape_colors()[static_cast<size_t>(s.background)].name + " background";
}

void shape_geometry(const ShapeSpec& s, int size, double* cx, double* cy, double* r) {
  static const double cells[3] = {0.22, 0.5, 0.78};
  *cx = cells[s.position % 3] * size, *cy = cells[s.position / 3] * size;
  *r = (s.large ? 0.19 : 0.11) * size;
}

Image render_shape(const ShapeSpec& s, int size) {
  if (size < 8) throw std::invalid_argument("shapes: size must be >= 8, not " + std::to_string(size));
  double cx, cy, r;
  shape_geometry(s, size, &cx, &cy, &r);
  const uint8_t* fg = shape_colors()[static_cast<size_t>(s.color)].rgb;
  const uint8_t* bg = shape_colors()[static_cast<size_t>(s.background)].rgb;
  Image img(size, size, 3);
  constexpr int kSS = 4;
  for (int y = 0; y < size; ++y)
    for (int x = 0; x < size; ++x) {
      int hits = 0;
      for (int sy = 0; sy < kSS; ++sy)
        for (int sx = 0; sx < kSS; ++sx) hits += inside(s, cx, cy, r, x + (sx + 0.5) / kSS, y + (sy + 0.5) / kSS);
      const double a = static_cast<double>(hits) / (kSS * kSS);
      uint8_t* p = img.at(x, y);
      for (int k = 0; k < 3; ++k) p[k] = static_cast<uint8_t>(std::lround(a * fg[k] + (1 - a) * bg[k]));
    }
  return img;
}

std::vector<std::string> shape_words() {
  std::vector<std::string> words = {"a", "small", "large"};
  for (const auto& c : shape_colors()) words.push_back(c.name);
  for (const auto& k : shape_kinds()) words.push_back(k);
  for (const char* w : {"at", "in", "on", "the", "top", "bottom", "left", "right", "center", "background"}) words.push_back(w);
  return words;
}

std::vector<std::string> shapes_vocab() {
  std::vector<std::string> v = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"};
  std::set<std::string> seen(v.begin(), v.end());
  auto add = [&](const std::string& t) {
    if (seen.insert(t).second) v.push_back(t);
  };
  for (const auto& w : shape_words()) add(w);
  for (char ch = 'a'; ch <= 'z'; ++ch) add(std::string(1, ch));
  for (char ch = 'a'; ch <= 'z'; ++ch) add(std::string("##") + ch);
  return v;
}

int64_t write_shapes(const ShapesOptions& opt) {
  if (opt.out_dir.empty()) throw std::invalid_argument("OUT_DIR is required");
  if (opt.count < 1) throw std::invalid_argument("--count must be >= 1");
  if (opt.size < 8 || opt.size > 4096) throw std::invalid_argument("--size must be in [8, 4096]");
  shape_spec(opt.seed, opt.set, 0);  // validates the set name
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(opt.out_dir, ec);
  if (!fs::is_directory(opt.out_dir)) throw std::runtime_error(opt.out_dir + ": cannot create the folder");
  for (int64_t i = 0; i < opt.count; ++i) {
    const ShapeSpec s = shape_spec(opt.seed, opt.set, i);
    char stem[32];
    std::snprintf(stem, sizeof stem, "%06lld", static_cast<long long>(i));
    const std::string base = opt.out_dir + "/" + stem;
    write_png(base + ".png", render_shape(s, opt.size));
    std::ofstream f(base + ".txt", std::ios::binary | std::ios::trunc);
    f << shape_caption(s) << "\n";
    if (!f) throw std::runtime_error(base + ".txt: write failed");
  }
  std::ofstream v(opt.out_dir + "/vocab.txt", std::ios::binary | std::ios::trunc);
  for (const auto& t : shapes_vocab()) v << t << "\n";
  if (!v) throw std::runtime_error(opt.out_dir + "/vocab.txt: write failed");
  return opt.count;
}

namespace {
const char* kShapesUsage =
    "usage: flowrun prep shapes OUT_DIR [--count 2000] [--size 32] [--seed 1] [--set base|lora]\n"
    "\n"
    "Draws the DiT demo's image-text set: one colored shape (circle, square, triangle, diamond;\n"
    "small or large) in a cell of a 3x3 grid on a plain background, with an exact caption:\n"
    "  OUT_DIR/NNNNNN.png, OUT_DIR/NNNNNN.txt  \"a small red circle at the top left on a blue background\"\n"
    "  OUT_DIR/vocab.txt                       BERT WordPiece vocab of every word either set uses\n"
    "\n"
    "  --count N      images (default 2000)\n"
    "  --size S       width = height in pixels (default 32)\n"
    "  --seed K       the same seed gives the same images (default 1)\n"
    "  --set base     colors red green blue yellow white black gray: never purple\n"
    "  --set lora     every shape purple: a concept the base set never shows\n"
    "\n"
    "Pack it for training with: flowrun prep images OUT_DIR PREFIX\n";
}  // namespace

int prep_shapes_command(const std::vector<std::string>& args) {
  ShapesOptions opt;
  return run_cli_command("prep shapes", kShapesUsage, args, [&](const CliArgs& cl) {
    for (const auto& [a, v] : cl.options) {
      if (a == "--count") {
        opt.count = static_cast<int64_t>(cli_uint(a, v));
      } else if (a == "--size") {
        opt.size = static_cast<int>(std::min<uint64_t>(cli_uint(a, v), 1 << 20));
      } else if (a == "--seed") {
        opt.seed = cli_uint(a, v);
      } else if (a == "--set") {
        opt.set = v;
      } else {
        throw std::invalid_argument("unknown option " + a);
      }
    }
    const std::vector<std::string>& positional = cl.positional;
    if (positional.size() != 1) throw std::invalid_argument("expected one OUT_DIR, got " + std::to_string(positional.size()));
    opt.out_dir = positional[0];
    if (opt.set != "base" && opt.set != "lora") throw std::invalid_argument("--set: unknown set '" + opt.set + "' (known: base, lora)");
    const int64_t n = write_shapes(opt);
    std::printf("prep shapes: %lld %dx%d images (set %s, seed %llu) -> %s/NNNNNN.{png,txt}, %s/vocab.txt (%zu tokens)\n",
                static_cast<long long>(n), opt.size, opt.size, opt.set.c_str(), static_cast<unsigned long long>(opt.seed),
                opt.out_dir.c_str(), opt.out_dir.c_str(), shapes_vocab().size());
    return 0;
  });
}

}  // namespace flowrun
