// Helpers for the data and file-format tests (tests/formats, tests/nodes): where the files made
// by scripts/data.sh are, the fortunes text, small file utilities, test images. Torch-free.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "formats/image_io.hpp"
#include "prep/prep_images.hpp"
#include "data/shapes.hpp"

namespace flowrun::test {

inline std::string data_dir() { return std::string(FLOWRUN_SOURCE_DIR) + "/data"; }
inline std::string gpt2_vocab() { return data_dir() + "/gpt2/vocab.json"; }
inline std::string gpt2_merges() { return data_dir() + "/gpt2/merges.txt"; }

// A test that needs what scripts/data.sh makes (data/: GPT-2's BPE files, the fortunes token
// shards, the shapes sets) starts with FLOWRUN_NEEDS_DATA(files...): without them it is skipped,
// saying which file and what to run (ctest lists it as skipped), so a build by hand runs the
// rest. scripts/test.sh, and so CI, runs scripts/data.sh first: there nothing is skipped.
#define FLOWRUN_NEEDS_DATA(...)                                                                           \
  do {                                                                                                     \
    for (const std::string& needed_ : {__VA_ARGS__})                                                      \
      if (!std::filesystem::exists(needed_))                                                              \
        GTEST_SKIP() << needed_ << " is missing: run scripts/data.sh first (scripts/test.sh does it)"; \
  } while (0)

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_text(const std::string& path, const std::string& text) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << text;
}

// The plain-text fortune files of Debian's `fortunes` package (not the .dat indexes, not the
// .u8 links), sorted: what scripts/data.sh tokenizes.
inline std::vector<std::string> fortune_files() {
  std::vector<std::string> files;
  const std::string dir = "/usr/share/games/fortunes";
  if (!std::filesystem::is_directory(dir)) return files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (e.is_symlink() || !e.is_regular_file() || e.path().extension() == ".dat" || e.path().extension() == ".u8") continue;
    files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

// Every fortune (the text between "%" lines) of every fortune file, in order.
inline std::vector<std::string> all_fortunes() {
  std::vector<std::string> out;
  for (const std::string& f : fortune_files()) {
    std::istringstream in(read_text(f));
    std::string line, cur;
    while (std::getline(in, line)) {
      if (line == "%") {
        if (!cur.empty()) out.push_back(cur);
        cur.clear();
      } else {
        cur += line + "\n";
      }
    }
    if (!cur.empty()) out.push_back(cur);
  }
  return out;
}

// An image whose pixels say where they are: (x * 16 + y, y * 8, (x + y) * 4).
inline Image gradient(int w, int h) {
  Image img(w, h, 3);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      uint8_t* p = img.at(x, y);
      p[0] = static_cast<uint8_t>(x * 16 + y), p[1] = static_cast<uint8_t>(y * 8), p[2] = static_cast<uint8_t>((x + y) * 4);
    }
  return img;
}

// A PNG whose header is fine but whose image data is corrupt (found only when decoding).
inline std::string corrupt_body_png(const Image& img) {
  std::string b = encode_png(img);
  for (size_t i = b.size() - 24; i < b.size() - 16; ++i) b[i] = static_cast<char>(b[i] ^ 0x5A);
  return b;
}

// The shapes set `set` ("base", "lora") of `count` images of size x size, rendered into
// DIR/SET-png (with vocab.txt) and packed into DIR/SET.{train,val}-NNNNNN.tar with 10 % held
// out, as scripts/data.sh makes the demo's at 32x32: what the DiT and VAE graph tests train on.
inline void make_shapes_set(const std::string& dir, const std::string& set, int64_t count, int size = 16) {
  ShapesOptions so;
  so.out_dir = dir + "/" + set + "-png";
  so.count = count;
  so.size = size;
  so.set = set;
  write_shapes(so);
  PrepImagesOptions po;
  po.dir = so.out_dir;
  po.out = dir + "/" + set;
  po.val_fraction = 0.1;  // the graphs' evaluators read val
  po.quiet = true;
  prep_images(po);
}

}  // namespace flowrun::test
