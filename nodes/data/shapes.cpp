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

namespace flowrun {

namespace {

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
  if (set != "base" && set != "lora" && set != "all")
    throw std::invalid_argument("unknown shapes set '" + set + "' (known: base, lora, all)");
  const bool lora = set == "lora", all = set == "all";
  Rng rng{mix_seed({seed, kSeedTagShapes, lora ? 1ull : all ? 2ull : 0ull, static_cast<uint64_t>(index)})};
  ShapeSpec s;
  const int base_colors = purple_index();  // colors 0 .. base_colors-1 never include purple
  s.kind = shape_kinds()[static_cast<size_t>(rng.below(static_cast<int>(shape_kinds().size())))];
  s.large = rng.below(2) == 1;
  s.position = rng.below(9);
  s.color = lora ? purple_index() : rng.below(all ? base_colors + 1 : base_colors);
  // Backgrounds are base colors in every set; in base and all, any but the shape's.
  const bool base_shape = s.color < base_colors;
  s.background = rng.below(base_shape ? base_colors - 1 : base_colors);
  if (base_shape && s.background >= s.color) ++s.background;
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

std::vector<double> shape_coverage(const ShapeSpec& s, int size) {
  if (size < 8) throw std::invalid_argument("shapes: size must be >= 8, not " + std::to_string(size));
  double cx, cy, r;
  shape_geometry(s, size, &cx, &cy, &r);
  std::vector<double> a(static_cast<size_t>(size) * size);
  constexpr int kSS = 4;
  for (int y = 0; y < size; ++y)
    for (int x = 0; x < size; ++x) {
      int hits = 0;
      for (int sy = 0; sy < kSS; ++sy)
        for (int sx = 0; sx < kSS; ++sx) hits += inside(s, cx, cy, r, x + (sx + 0.5) / kSS, y + (sy + 0.5) / kSS);
      a[static_cast<size_t>(y) * size + x] = static_cast<double>(hits) / (kSS * kSS);
    }
  return a;
}

Image render_shape(const ShapeSpec& s, int size) {
  const std::vector<double> cover = shape_coverage(s, size);
  const uint8_t* fg = shape_colors()[static_cast<size_t>(s.color)].rgb;
  const uint8_t* bg = shape_colors()[static_cast<size_t>(s.background)].rgb;
  Image img(size, size, 3);
  for (int y = 0; y < size; ++y)
    for (int x = 0; x < size; ++x) {
      const double a = cover[static_cast<size_t>(y) * size + x];
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

// ---- prompt fidelity ----------------------------------------------------------------------------

ShapeSpec parse_shape_caption(const std::string& caption) {
  auto bad = [&](const std::string& why) {
    return std::invalid_argument("not a shapes caption: '" + caption + "': " + why +
                                 " (expected e.g. 'a small red circle at the top left on a blue background')");
  };
  auto color = [&](const std::string& w) {
    for (size_t i = 0; i < shape_colors().size(); ++i)
      if (shape_colors()[i].name == w) return static_cast<int>(i);
    throw bad("unknown color '" + w + "'");
  };
  std::istringstream in(caption);
  std::vector<std::string> w;
  for (std::string t; in >> t;) w.push_back(t);
  // a SIZE COLOR KIND WHERE... on a COLOR background
  if (w.size() < 8 || w[0] != "a" || w[w.size() - 1] != "background" || w[w.size() - 3] != "a" ||
      w[w.size() - 4] != "on")
    throw bad("not 'a SIZE COLOR SHAPE WHERE on a COLOR background'");
  ShapeSpec s;
  if (w[1] != "small" && w[1] != "large") throw bad("size '" + w[1] + "' is not small or large");
  s.large = w[1] == "large";
  s.color = color(w[2]);
  s.kind = w[3];
  if (std::find(shape_kinds().begin(), shape_kinds().end(), s.kind) == shape_kinds().end())
    throw bad("unknown shape '" + s.kind + "'");
  s.background = color(w[w.size() - 2]);
  std::string where;  // "in the center", "on the left", "at the top left"
  for (size_t i = 4; i + 4 < w.size(); ++i) where += (where.empty() ? "" : " ") + w[i];
  s.position = -1;
  for (size_t i = 0; i < shape_positions().size(); ++i) {
    ShapeSpec t = s;
    t.position = static_cast<int>(i);
    if (shape_caption(t) == caption) s.position = static_cast<int>(i);
  }
  if (s.position < 0) throw bad("unknown place '" + where + "'");
  return s;
}

namespace {

double distance(const uint8_t* a, const double* b) {
  double d = 0;
  for (int k = 0; k < 3; ++k) d += (a[k] - b[k]) * (a[k] - b[k]);
  return std::sqrt(d);
}

int nearest_color(const double* rgb) {
  int best = 0;
  double best_d = 1e30;
  for (size_t i = 0; i < shape_colors().size(); ++i) {
    const double d = distance(shape_colors()[i].rgb, rgb);
    if (d < best_d) best_d = d, best = static_cast<int>(i);
  }
  return best;
}

}  // namespace

ShapeScore score_shape_image(const Image& img, const ShapeSpec& want) {
  if (img.w != img.h || img.c != 3 || img.w < 8)
    throw std::invalid_argument("score_shape_image: expected a square RGB image of at least 8x8, got " +
                                std::to_string(img.w) + "x" + std::to_string(img.h) + "x" + std::to_string(img.c));
  const int n = img.w;
  ShapeScore sc;
  // Background: the per-channel median of the border pixels, named by the nearest palette color.
  std::vector<uint8_t> border[3];
  for (int i = 0; i < n; ++i)
    for (const auto& [x, y] : {std::pair{i, 0}, std::pair{i, n - 1}, std::pair{0, i}, std::pair{n - 1, i}})
      for (int k = 0; k < 3; ++k) border[k].push_back(img.at(x, y)[k]);
  double bg[3];
  for (int k = 0; k < 3; ++k) {
    std::nth_element(border[k].begin(), border[k].begin() + border[k].size() / 2, border[k].end());
    bg[k] = border[k][border[k].size() / 2];
  }
  sc.background = nearest_color(bg);
  // The shape: pixels far from the background (half the distance between the two closest palette
  // colors, gray and the others, is well above 60).
  constexpr double kFar = 60;
  auto far = [&](int x, int y) { return distance(img.at(x, y), bg) > kFar; };
  int64_t shape_px = 0;
  for (int y = 0; y < n; ++y)
    for (int x = 0; x < n; ++x) shape_px += far(x, y);
  // Its color at the prompted place: inside the small shape of the prompted kind there (which a
  // large one covers too), the mean of the far pixels, if they are most of that region.
  ShapeSpec small = want;
  small.large = false;
  const std::vector<double> core = shape_coverage(small, n);
  double sum[3] = {0, 0, 0};
  int64_t in_core = 0, far_core = 0;
  for (int y = 0; y < n; ++y)
    for (int x = 0; x < n; ++x) {
      if (core[static_cast<size_t>(y) * n + x] < 1.0) continue;
      ++in_core;
      if (!far(x, y)) continue;
      ++far_core;
      for (int k = 0; k < 3; ++k) sum[k] += img.at(x, y)[k];
    }
  if (in_core > 0 && far_core * 2 > in_core) {
    for (double& v : sum) v /= static_cast<double>(far_core);
    sc.color = nearest_color(sum);
  }
  // Kind: the image's shape as a coverage map (each pixel's distance from the background over
  // the shape color's: a rendered edge pixel a fg + (1 - a) bg gives a), against each kind's
  // rendered coverage at the prompted place, small or large: the best overlap (the sum of the
  // smaller of the two over the sum of the larger). The shape color: the mean of the pixels at
  // least 80 % as far from the background as the farthest.
  if (shape_px > 0) {
    std::vector<double> dist(static_cast<size_t>(n) * n);
    double dmax = 0;
    for (int y = 0; y < n; ++y)
      for (int x = 0; x < n; ++x) dmax = std::max(dmax, dist[static_cast<size_t>(y) * n + x] = distance(img.at(x, y), bg));
    double fg[3] = {0, 0, 0};
    int64_t m = 0;
    for (int y = 0; y < n; ++y)
      for (int x = 0; x < n; ++x)
        if (dist[static_cast<size_t>(y) * n + x] >= 0.8 * dmax) {
          ++m;
          for (int k = 0; k < 3; ++k) fg[k] += img.at(x, y)[k];
        }
    double fg_mean[3];
    for (int k = 0; k < 3; ++k) fg_mean[k] = fg[k] / static_cast<double>(m);
    double dfg = 0;
    for (int k = 0; k < 3; ++k) dfg += (fg_mean[k] - bg[k]) * (fg_mean[k] - bg[k]);
    dfg = std::sqrt(dfg);
    std::vector<double> alpha(dist.size());
    for (size_t i = 0; i < dist.size(); ++i) alpha[i] = std::min(1.0, dist[i] / dfg);
    double best = -1;
    const auto& kinds = shape_kinds();
    for (size_t k = 0; k < kinds.size(); ++k)
      for (bool l : {false, true}) {
        ShapeSpec t = want;
        t.kind = kinds[k];
        t.large = l;
        const std::vector<double> cov = shape_coverage(t, n);
        double lo = 0, hi = 0;
        for (size_t i = 0; i < cov.size(); ++i) lo += std::min(cov[i], alpha[i]), hi += std::max(cov[i], alpha[i]);
        if (hi > 0 && lo / hi > best) best = lo / hi, sc.kind = static_cast<int>(k);
      }
  }
  // Size: the shape's pixel count against the rendered small and large shape of the kind it
  // shows (else the prompted kind): the nearer one in ratio, so a wrong kind fails only its own
  // check.
  ShapeSpec seen = want;
  if (sc.kind >= 0) seen.kind = shape_kinds()[static_cast<size_t>(sc.kind)];
  double area_small = 0, area_large = 0;
  seen.large = false;
  for (double a : shape_coverage(seen, n)) area_small += a;
  seen.large = true;
  for (double a : shape_coverage(seen, n)) area_large += a;
  if (shape_px > 0) {
    const double px = static_cast<double>(shape_px);
    sc.large = std::abs(std::log(px / area_large)) < std::abs(std::log(px / area_small)) ? 1 : 0;
  }
  sc.background_ok = sc.background == want.background;
  sc.color_ok = sc.color == want.color;
  sc.size_ok = sc.large == (want.large ? 1 : 0);
  sc.kind_ok = sc.kind >= 0 && shape_kinds()[static_cast<size_t>(sc.kind)] == want.kind;
  return sc;
}

}  // namespace flowrun
