// `flowrun prep arrow` (prep_arrow.hpp): image + caption pairs -> csv2arrow.py's Arrow files and
// an IndexKits Index V2 over them.
#include "prep/prep_arrow.hpp"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <stdexcept>

#include "formats/arrow_file.hpp"
#include "formats/files.hpp"
#include "formats/image_io.hpp"
#include "formats/md5.hpp"
#include "prep/cli_args.hpp"
#include "prep/prep_images.hpp"

namespace fs = std::filesystem;

namespace flowrun {

namespace {

const char* kArrowUsage =
    "usage: flowrun prep arrow DIR OUT_DIR [--rows-per-file 5000] [--caption-column text_zh] [--relative-paths 1]\n"
    "\n"
    "Packs image + caption pairs (X.png|X.jpg|X.jpeg with X.txt beside it; DIR is read recursively)\n"
    "into HunyuanDiT's data layout, which its trainer (IndexKits) and flowrun's image_text_shards read:\n"
    "  OUT_DIR/arrows/00000.arrow ...  csv2arrow.py's Arrow files: text_zh, md5, width, height, image\n"
    "  OUT_DIR/index.json              an IndexKits Index V2 over them (every row once, in order)\n"
    "\n"
    "  --rows-per-file N     rows per Arrow file (default 5000, as csv2arrow.py)\n"
    "  --caption-column C    the caption's column (default text_zh)\n"
    "  --relative-paths 1    name the Arrow files relative to OUT_DIR in the index (default: absolute,\n"
    "                        as IndexKits opens them from the current folder)\n"
    "\n"
    "Images are stored as they are (not re-encoded), after a check that they decode. An image\n"
    "without a caption (or with an empty one) or one that does not decode is warned about and\n"
    "skipped. Train on it: flowrun graphs/hydit_v12_lora.yaml data.path=OUT_DIR/index.json\n"
    "Exit codes: 0 done, 2 bad usage or input, 1 a write failed.\n";

std::string arrow_name(int64_t k) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%05lld.arrow", static_cast<long long>(k));
  return buf;
}

}  // namespace

PrepArrowSummary prep_arrow(const PrepArrowOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  if (opt.dir.empty() || opt.out.empty()) throw std::invalid_argument("DIR and OUT_DIR are required");
  if (opt.rows_per_file < 1) throw std::invalid_argument("--rows-per-file must be >= 1");
  if (opt.caption_column.empty() || opt.caption_column == "md5" || opt.caption_column == "width" ||
      opt.caption_column == "height" || opt.caption_column == "image")
    throw std::invalid_argument("--caption-column '" + opt.caption_column + "': must be a name other than md5, width, height, image");
  if (!arrow_available()) throw std::runtime_error(arrow_missing_message());
  PrepArrowSummary s;
  const std::vector<ImageCaptionPair> pairs = find_image_caption_pairs(opt.dir, opt.quiet, &s.no_caption, &s.orphan_captions);
  const fs::path out_dir = fs::absolute(opt.out), arrows = out_dir / "arrows";
  fs::create_directories(arrows);

  std::vector<ArrowColumn> cols;
  auto start_file = [&] {
    cols = {{opt.caption_column, ArrowKind::string, {}, {}}, {"md5", ArrowKind::string, {}, {}}, {"width", ArrowKind::integer, {}, {}},
            {"height", ArrowKind::integer, {}, {}}, {"image", ArrowKind::binary, {}, {}}};
  };
  std::vector<int64_t> cum_length;
  nlohmann::json files = nlohmann::json::array();
  auto finish_file = [&] {
    const int64_t rows = static_cast<int64_t>(cols[0].values.size());
    if (rows == 0) return;
    const fs::path path = arrows / arrow_name(s.files++);
    write_arrow_file(path.string(), cols);
    s.arrow_paths.push_back(path.string());
    files.push_back(opt.relative_paths ? fs::relative(path, out_dir).generic_string() : path.string());
    cum_length.push_back((cum_length.empty() ? 0 : cum_length.back()) + rows);
    start_file();
  };
  start_file();
  for (const ImageCaptionPair& p : pairs) {
    const std::string caption = trim_space(read_file(p.caption));
    if (caption.empty()) {
      ++s.empty_caption;
      if (!opt.quiet) std::fprintf(stderr, "warning: %s: empty caption: skipped\n", p.caption.c_str());
      continue;
    }
    std::string bytes = read_file(p.image);
    Image img;
    try {
      img = decode_image(bytes, p.image);
    } catch (const ImageError& e) {
      ++s.bad_image;
      if (!opt.quiet) std::fprintf(stderr, "warning: %s: skipped\n", e.what());
      continue;
    }
    cols[0].values.push_back(caption);
    cols[1].values.push_back(md5_hex(bytes));
    cols[2].ints.push_back(img.w);
    cols[3].ints.push_back(img.h);
    cols[4].values.push_back(std::move(bytes));
    ++s.rows;
    if (static_cast<int64_t>(cols[0].values.size()) == opt.rows_per_file) finish_file();
  }
  finish_file();
  if (s.rows == 0) throw std::invalid_argument(opt.dir + ": no usable pairs (every one was skipped)");
  for (int64_t k = s.files;; ++k) {  // files of an earlier, larger run
    std::error_code ec;
    if (!fs::remove(arrows / arrow_name(k), ec)) break;
  }
  // The Index V2, as IndexKits' IndexV2Builder writes a base index.
  nlohmann::json idx;
  idx["data_type"] = {"Made by flowrun prep arrow", "source=" + opt.dir};
  idx["config_file"] = "";
  idx["indices_file"] = "";
  idx["arrow_files"] = files;
  idx["cum_length"] = cum_length;
  std::vector<int64_t> groups(cum_length.size()), indices(static_cast<size_t>(s.rows));
  for (size_t k = 0; k < cum_length.size(); ++k) groups[k] = cum_length[k] - (k ? cum_length[k - 1] : 0);
  for (int64_t i = 0; i < s.rows; ++i) indices[static_cast<size_t>(i)] = i;
  idx["group_length"] = groups;
  idx["indices"] = indices;
  idx["example_indices"] = nlohmann::json::array();
  s.index_path = (out_dir / "index.json").string();
  write_file_atomic(s.index_path, idx.dump(4) + "\n");
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return s;
}

int prep_arrow_command(const std::vector<std::string>& args) {
  PrepArrowOptions opt;
  return run_cli_command("prep arrow", kArrowUsage, args, [&](const CliArgs& cl) {
    for (const auto& [a, v] : cl.options) {
      if (a == "--rows-per-file") opt.rows_per_file = static_cast<int64_t>(cli_uint(a, v));
      else if (a == "--caption-column") opt.caption_column = v;
      else if (a == "--relative-paths") opt.relative_paths = cli_uint(a, v) != 0;
      else throw std::invalid_argument("unknown option " + a);
    }
    if (cl.positional.size() != 2)
      throw std::invalid_argument("expected DIR and OUT_DIR, got " + std::to_string(cl.positional.size()) + " arguments");
    opt.dir = cl.positional[0], opt.out = cl.positional[1];
    const PrepArrowSummary s = prep_arrow(opt);
    std::printf("prep arrow: %lld rows in %lld Arrow files; skipped: %lld without caption, %lld empty captions, %lld bad images; %.2f s\n",
                static_cast<long long>(s.rows), static_cast<long long>(s.files), static_cast<long long>(s.no_caption),
                static_cast<long long>(s.empty_caption), static_cast<long long>(s.bad_image), s.seconds);
    std::printf("  %s/arrows/*.arrow, %s\n", opt.out.c_str(), s.index_path.c_str());
    return 0;
  });
}

}  // namespace flowrun
