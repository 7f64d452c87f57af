// `flowrun prep arrow` (prep_arrow.hpp): image + caption pairs -> csv2arrow.py's Arrow files and
// an IndexKits Index V2 over them.
//
// In order: the names are checked (UTF-8, an OUT_DIR that is empty, new, or an earlier output
// with --replace 1) and the free space against the images' bytes, before anything is written;
// the files and the index are written into a staging folder beside OUT_DIR, rows streamed into
// record batches of at most kBatchBytes; the staging folder then takes OUT_DIR's place in one
// rename (an exchange when OUT_DIR exists, the earlier output removed after). A run stopped or
// failed at any point leaves OUT_DIR as it was: never old and new files under one index.
#include "prep/prep_arrow.hpp"

#include <fcntl.h>
#include <sys/statvfs.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "formats/arrow_file.hpp"
#include "formats/files.hpp"
#include "formats/image_io.hpp"
#include "formats/md5.hpp"
#include "formats/utf8.hpp"
#include "prep/cli_args.hpp"
#include "prep/prep_images.hpp"

namespace fs = std::filesystem;

namespace flowrun {

namespace {

const char* kArrowUsage =
    "usage: flowrun prep arrow DIR OUT_DIR [--rows-per-file 5000] [--caption-column text_zh] [--relative-paths 1]\n"
    "                          [--replace 1] [--strict 1]\n"
    "\n"
    "Packs image + caption pairs (X.png|X.jpg|X.jpeg with X.txt beside it; DIR is read recursively)\n"
    "into HunyuanDiT's data layout, which its trainer (IndexKits) and flowrun's image_text_shards read:\n"
    "  OUT_DIR/arrows/00000.arrow ...  csv2arrow.py's Arrow files: text_zh, md5, width, height, image\n"
    "  OUT_DIR/index.json              an IndexKits Index V2 over them (every row once, in order)\n"
    "  OUT_DIR/prep_arrow.json         what was written, skipped (each file and why) and converted\n"
    "\n"
    "  --rows-per-file N     rows per Arrow file (default 5000, as csv2arrow.py)\n"
    "  --caption-column C    the caption's column (default text_zh)\n"
    "  --relative-paths 1    name the Arrow files relative to OUT_DIR in the index (default: absolute,\n"
    "                        as IndexKits opens them from the current folder)\n"
    "  --replace 1           replace an earlier `prep arrow` output in OUT_DIR (refused otherwise)\n"
    "  --strict 1            stop at the first pair that would be skipped, naming it\n"
    "\n"
    "Images are stored as they are (not re-encoded), after a check that they decode as PIL's\n"
    "convert(\"RGB\") would (16-bit PNGs and CMYK JPEGs are counted as converted). A pair without\n"
    "caption, with an empty one, an image that does not decode or a file that cannot be read is\n"
    "skipped and listed; a caption that is not UTF-8 is repaired (each bad sequence becomes U+FFFD)\n"
    "and counted. OUT_DIR is replaced whole at the end: a run stopped midway changes nothing.\n"
    "Train on it: flowrun graphs/hydit_v12_lora.yaml data.path=OUT_DIR/index.json\n"
    "Exit codes: 0 done, 2 bad usage or input, 1 a write failed.\n";

// A record batch's image bytes at most: memory holds one batch (and Arrow's copy of it), and a
// batch's 32-bit binary offsets stay far from 2 GiB.
constexpr int64_t kBatchBytes = int64_t(64) << 20;

std::string arrow_name(int64_t k) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%05lld.arrow", static_cast<long long>(k));
  return buf;
}

void check_utf8_name(const std::string& what, const std::string& path) {
  if (!valid_utf8(path))
    throw std::invalid_argument(what + " '" + repair_utf8(path) + "' is not UTF-8 (shown with U+FFFD for the bad bytes): the index "
                                "names its files in JSON, which holds UTF-8 only; rename the folder");
}

// OUT_DIR may be missing, empty, or (with --replace) an earlier output: arrows/ holding .arrow
// files only, index.json, prep_arrow.json. Anything else there is named and refused.
void check_out_dir(const fs::path& out, bool replace) {
  std::error_code ec;
  if (!fs::exists(out, ec)) return;
  if (!fs::is_directory(out, ec)) throw std::invalid_argument("OUT_DIR " + out.string() + " exists and is not a folder");
  std::vector<std::string> foreign;
  bool any = false;
  for (const auto& e : fs::directory_iterator(out)) {
    any = true;
    const std::string name = e.path().filename().string();
    if (name == "index.json" || name == "prep_arrow.json") continue;
    if (name == "arrows" && e.is_directory()) {
      for (const auto& a : fs::directory_iterator(e.path()))
        if (a.path().extension() != ".arrow") foreign.push_back("arrows/" + a.path().filename().string());
      continue;
    }
    foreign.push_back(name);
  }
  if (!any) return;
  if (!foreign.empty())
    throw std::invalid_argument("OUT_DIR " + out.string() + " holds " + repair_utf8(foreign[0]) +
                                (foreign.size() > 1 ? " and " + std::to_string(foreign.size() - 1) + " more" : "") +
                                ", which `prep arrow` did not write: name an empty or new folder");
  if (!replace)
    throw std::invalid_argument("OUT_DIR " + out.string() + " holds an earlier output (index.json, arrows/): pass --replace 1 to "
                                "replace it, or name a new folder");
}

// The space the output needs against what the device has free, before writing: the images'
// bytes plus a little per row (captions, md5, sizes, Arrow's framing).
void check_space(const fs::path& parent, const std::vector<ImageCaptionPair>& pairs) {
  uint64_t need = 0;
  for (const auto& p : pairs) {
    std::error_code ec;
    const auto n = fs::file_size(p.image, ec);
    if (!ec) need += n + 256;
  }
  fs::path existing = parent;  // the nearest folder that exists: nothing is created before the checks pass
  std::error_code ec;
  while (!existing.empty() && !fs::exists(existing, ec) && existing != existing.parent_path()) existing = existing.parent_path();
  struct statvfs v {};
  if (::statvfs(existing.c_str(), &v) != 0) return;
  const uint64_t free_bytes = static_cast<uint64_t>(v.f_bavail) * v.f_frsize;
  if (need > free_bytes)
    throw std::runtime_error("no space left on the device holding " + parent.string() + ": the output needs ~" + std::to_string(need) +
                             " bytes (the images as they are), " + std::to_string(free_bytes) + " are free");
}

// Exchanges two paths in one step (Linux renameat2), or renames `from` onto a missing `to`.
bool exchange(const fs::path& a, const fs::path& b) {
#ifdef RENAME_EXCHANGE
  return ::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0;
#else
  (void)a, (void)b;
  errno = ENOSYS;
  return false;
#endif
}

}  // namespace

PrepArrowSummary prep_arrow(const PrepArrowOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  if (opt.dir.empty() || opt.out.empty()) throw std::invalid_argument("DIR and OUT_DIR are required");
  if (opt.rows_per_file < 1) throw std::invalid_argument("--rows-per-file must be >= 1");
  if (opt.caption_column.empty() || opt.caption_column == "md5" || opt.caption_column == "width" ||
      opt.caption_column == "height" || opt.caption_column == "image")
    throw std::invalid_argument("--caption-column '" + opt.caption_column + "': must be a name other than md5, width, height, image");
  check_utf8_name("--caption-column", opt.caption_column);
  if (!arrow_available()) throw std::runtime_error(arrow_missing_message());
  // ---- checks before anything is written
  check_utf8_name("DIR", fs::absolute(opt.dir).string());
  const fs::path out_dir = fs::absolute(opt.out).lexically_normal();
  const fs::path final_dir = out_dir.filename().empty() ? out_dir.parent_path() : out_dir;  // "out/" -> "out"
  check_utf8_name("OUT_DIR", final_dir.string());
  check_out_dir(final_dir, opt.replace);
  PrepArrowSummary s;
  const std::vector<ImageCaptionPair> pairs = find_image_caption_pairs(opt.dir, opt.quiet, &s.no_caption, &s.orphan_captions);
  const fs::path parent = final_dir.parent_path();
  check_space(parent, pairs);
  fs::create_directories(parent);

  // ---- the staging folder beside OUT_DIR (a leftover of a stopped run is removed first)
  const fs::path staging = parent / ("." + final_dir.filename().string() + ".prep-arrow-partial");
  std::error_code ec;
  fs::remove_all(staging, ec);
  fs::create_directories(staging / "arrows");
  struct Cleanup {  // removes the staging folder unless it took OUT_DIR's place
    fs::path dir;
    ~Cleanup() {
      std::error_code e;
      if (!dir.empty()) fs::remove_all(dir, e);
    }
  } cleanup{staging};

  nlohmann::json skipped = nlohmann::json::array();
  auto skip = [&](const std::string& file, const std::string& why, int64_t* counter) {
    if (opt.strict) throw std::invalid_argument(file + ": " + why + " (--strict 1 stops here; without it the pair is skipped and listed)");
    ++*counter;
    if (!opt.quiet) std::fprintf(stderr, "warning: %s: %s: skipped\n", file.c_str(), why.c_str());
    skipped.push_back({{"file", repair_utf8(file)}, {"why", repair_utf8(why)}});
  };

  std::vector<ArrowColumn> cols;
  auto clear_batch = [&] {
    cols = {{opt.caption_column, ArrowKind::string, {}, {}}, {"md5", ArrowKind::string, {}, {}}, {"width", ArrowKind::integer, {}, {}},
            {"height", ArrowKind::integer, {}, {}}, {"image", ArrowKind::binary, {}, {}}};
  };
  clear_batch();
  std::unique_ptr<ArrowFileWriter> writer;
  int64_t file_rows = 0, batch_bytes = 0;
  std::vector<int64_t> cum_length;
  nlohmann::json files = nlohmann::json::array();
  auto flush_batch = [&] {
    if (cols[0].values.empty()) return;
    if (!writer) writer = std::make_unique<ArrowFileWriter>((staging / "arrows" / arrow_name(s.files)).string());
    writer->write(cols);
    clear_batch();
    batch_bytes = 0;
  };
  auto finish_file = [&] {
    flush_batch();
    if (!writer) return;
    writer->close();
    writer.reset();
    const fs::path path = final_dir / "arrows" / arrow_name(s.files++);  // where it will be
    s.arrow_paths.push_back(path.string());
    files.push_back(opt.relative_paths ? fs::relative(path, final_dir).generic_string() : path.string());
    cum_length.push_back((cum_length.empty() ? 0 : cum_length.back()) + file_rows);
    file_rows = 0;
  };
  for (const ImageCaptionPair& p : pairs) {
    std::string raw, bytes;
    try {
      raw = read_file(p.caption);
    } catch (const std::exception& e) {
      skip(p.caption, std::string("cannot be read (") + e.what() + ")", &s.unreadable);
      continue;
    }
    int64_t repaired = 0;
    const std::string caption = repair_utf8(trim_space(raw), &repaired);
    if (caption.empty()) {
      skip(p.caption, "empty caption", &s.empty_caption);
      continue;
    }
    try {
      bytes = read_file(p.image);
    } catch (const std::exception& e) {
      skip(p.image, std::string("cannot be read (") + e.what() + ")", &s.unreadable);
      continue;
    }
    Image img;
    std::string converted;
    try {
      img = decode_image(bytes, p.image, Alpha::drop, &converted);
    } catch (const ImageError& e) {
      skip(p.image, std::string("does not decode (") + e.what() + ")", &s.bad_image);
      continue;
    }
    if (repaired) {
      ++s.repaired_captions;
      if (!opt.quiet)
        std::fprintf(stderr, "warning: %s: not UTF-8: %lld byte sequence(s) replaced by U+FFFD\n", p.caption.c_str(),
                     static_cast<long long>(repaired));
    }
    if (!converted.empty()) ++s.converted[converted];
    batch_bytes += static_cast<int64_t>(bytes.size());
    cols[0].values.push_back(caption);
    cols[1].values.push_back(md5_hex(bytes));
    cols[2].ints.push_back(img.w);
    cols[3].ints.push_back(img.h);
    cols[4].values.push_back(std::move(bytes));
    ++s.rows, ++file_rows;
    if (file_rows == opt.rows_per_file) finish_file();
    else if (batch_bytes >= kBatchBytes) flush_batch();
  }
  finish_file();
  if (s.rows == 0) throw std::invalid_argument(opt.dir + ": no usable pairs (every one was skipped)");

  // The Index V2, as IndexKits' IndexV2Builder writes a base index.
  nlohmann::json idx;
  idx["data_type"] = {"Made by flowrun prep arrow", "source=" + fs::absolute(opt.dir).string()};
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
  write_file_atomic((staging / "index.json").string(), idx.dump(4) + "\n");
  nlohmann::json summary = {{"rows", s.rows},
                            {"arrow_files", s.files},
                            {"skipped", skipped},
                            {"repaired_captions", s.repaired_captions},
                            {"converted", s.converted},
                            {"no_caption", s.no_caption}};
  write_file_atomic((staging / "prep_arrow.json").string(), summary.dump(2) + "\n");

  // ---- into place: one step
  if (fs::exists(final_dir, ec)) {
    if (!exchange(staging, final_dir)) {  // a file system without the exchange: old aside, new in
      const fs::path aside = parent / ("." + final_dir.filename().string() + ".prep-arrow-old");
      fs::remove_all(aside, ec);
      fs::rename(final_dir, aside);
      fs::rename(staging, final_dir);
      fs::remove_all(aside, ec);
    }
    // the staging path now holds the earlier output, which Cleanup removes
  } else {
    fs::rename(staging, final_dir);
    cleanup.dir.clear();
  }
  s.index_path = (final_dir / "index.json").string();
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
      else if (a == "--replace") opt.replace = cli_uint(a, v) != 0;
      else if (a == "--strict") opt.strict = cli_uint(a, v) != 0;
      else throw std::invalid_argument("unknown option " + a);
    }
    if (cl.positional.size() != 2)
      throw std::invalid_argument("expected DIR and OUT_DIR, got " + std::to_string(cl.positional.size()) + " arguments");
    opt.dir = cl.positional[0], opt.out = cl.positional[1];
    const PrepArrowSummary s = prep_arrow(opt);
    std::string converted;
    for (const auto& [what, n] : s.converted) converted += ", " + std::to_string(n) + " " + what;
    std::printf("prep arrow: %lld rows in %lld Arrow files; skipped: %lld without caption, %lld empty captions, %lld bad images, "
                "%lld unreadable files; %lld captions repaired (not UTF-8); converted to RGB: %lld%s; %.2f s\n",
                static_cast<long long>(s.rows), static_cast<long long>(s.files), static_cast<long long>(s.no_caption),
                static_cast<long long>(s.empty_caption), static_cast<long long>(s.bad_image), static_cast<long long>(s.unreadable),
                static_cast<long long>(s.repaired_captions), static_cast<long long>(s.converted_count()), converted.c_str(), s.seconds);
    std::printf("  %s/arrows/*.arrow, %s (skipped files: %s/prep_arrow.json)\n", opt.out.c_str(), s.index_path.c_str(), opt.out.c_str());
    return 0;
  });
}

}  // namespace flowrun
