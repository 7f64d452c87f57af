// `flowrun prep arrow`: a folder of image + caption pairs -> HunyuanDiT's data layout, so that
// a flowrun user's data also loads in HunyuanDiT's own tools (and in flowrun's image_text_shards).
//
//   flowrun prep arrow DIR OUT_DIR [--rows-per-file 5000] [--caption-column text_zh] [--relative-paths]
//
// Pairs: as `flowrun prep images` (prep_images.hpp: X.png|jpg|jpeg with X.txt, recursive, sorted
// by path; no caption, an empty caption or an image that does not decode: warned and skipped).
// Writes, as hydit/data_loader/csv2arrow.py and IndexKits' `idk base` would:
//   OUT_DIR/arrows/00000.arrow, 00001.arrow, ...  Arrow IPC files of rows_per_file rows, columns
//       text_zh (string: the caption), md5 (string: hex MD5 of the image bytes), width, height
//       (int64), image (binary: the file's bytes as they are);
//   OUT_DIR/index.json  an Index V2 (base) over them: every row once, in order (data_type,
//       config_file, indices_file, arrow_files, cum_length, group_length, indices, example_indices).
// The index names the Arrow files by absolute path (IndexKits opens them from the current
// folder); --relative-paths writes them relative to OUT_DIR instead, which flowrun resolves
// beside the index and IndexKits from OUT_DIR only. Everything is written into a staging folder
// beside OUT_DIR, which then takes OUT_DIR's place in one rename: a stopped or failed run leaves
// OUT_DIR as it was. OUT_DIR must be new, empty, or an earlier output with --replace. Before
// anything is written: DIR and OUT_DIR must be UTF-8 (the index is JSON), the device must have
// room for the images. Memory: one record batch (64 MiB of images) at a time. Unreadable files
// are skipped like undecodable images (--strict stops instead); captions that are not UTF-8
// are repaired (U+FFFD) and counted; OUT_DIR/prep_arrow.json lists every skipped file and why.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace flowrun {

struct PrepArrowOptions {
  std::string dir, out;           // DIR, OUT_DIR
  int64_t rows_per_file = 5000;   // csv2arrow.py's
  std::string caption_column = "text_zh";
  bool relative_paths = false;
  bool replace = false;  // OUT_DIR may hold an earlier output, which is replaced
  bool strict = false;   // stop at the first pair that would be skipped
  bool quiet = false;
};

struct PrepArrowSummary {
  int64_t rows = 0, files = 0;
  int64_t no_caption = 0, empty_caption = 0, bad_image = 0, unreadable = 0, orphan_captions = 0;
  int64_t repaired_captions = 0;                // not UTF-8: bad sequences replaced by U+FFFD
  std::map<std::string, int64_t> converted;     // "16-bit PNG", "CMYK JPEG": images PIL converts
  int64_t converted_count() const {
    int64_t n = 0;
    for (const auto& [k, v] : converted) n += v;
    return n;
  }
  std::vector<std::string> arrow_paths;
  std::string index_path;
  double seconds = 0;
};

// Throws std::invalid_argument for bad options or no usable pairs, std::runtime_error when a
// write fails or flowrun was built without Arrow.
PrepArrowSummary prep_arrow(const PrepArrowOptions& opt);

// The command line (args after "prep arrow"). Exit code: 0, 2 bad usage or input, 1 write failure.
int prep_arrow_command(const std::vector<std::string>& args);

}  // namespace flowrun
