// Arrow files under an IndexKits Index V2, as image_text_shards' samples (arrow_image_text.hpp).
#include "data/arrow_image_text.hpp"

#include <glob.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>

#include <algorithm>
#include <filesystem>
#include <stdexcept>

#include "formats/arrow_file.hpp"
#include "formats/index_v2.hpp"
#include "formats/files.hpp"
#include "formats/utf8.hpp"
#include "hash.hpp"

namespace fs = std::filesystem;

namespace flowrun {

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

std::vector<std::string> glob_paths(const std::string& pattern) {
  glob_t g{};
  std::vector<std::string> out;
  if (::glob(pattern.c_str(), 0, nullptr, &g) == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  globfree(&g);
  std::sort(out.begin(), out.end());
  return out;
}

// A width or height column's value: an integer (or a whole float), or text holding one, as
// IndexKits reads them with int(...); 0 when null or not positive (the image header decides).
// Text that is not a number is an error naming file, column and row (int() fails on it too).
int size_value(const ArrowFile& f, int col, int64_t row) {
  if (col < 0 || f.is_null(col, row)) return 0;
  int64_t v = 0;
  if (f.kind(col) == ArrowKind::string) {
    const std::string text = trim_space(f.bytes(col, row));
    size_t used = 0;
    try {
      v = std::stoll(text, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != text.size())
      throw std::runtime_error(f.path() + ": column '" + f.columns()[static_cast<size_t>(col)] + "', row " + std::to_string(row) +
                               ": '" + text + "' is not a whole number (a width or height in pixels)");
  } else {
    v = f.integer(col, row);
  }
  return v > 0 && v < (int64_t{1} << 30) ? static_cast<int>(v) : 0;
}

}  // namespace

bool ArrowImageText::is_arrow_path(const std::string& path) { return ends_with(path, ".json") || ends_with(path, ".arrow"); }

ArrowImageText::~ArrowImageText() = default;

ArrowImageText::ArrowImageText(const std::string& path, const Options& opt) : ImageTextSource("image_text_shards", "train", opt.on_bad, opt.log) {
  alpha_ = Alpha::drop;  // as PIL's convert("RGB") in IndexKits' get_image
  if (!arrow_available()) throw std::runtime_error(path + ": " + arrow_missing_message());
  // Which rows, in which files: the index's entries, or every row of the files.
  std::vector<int64_t> cum;                  // rows before the end of each file (the index's cum_length)
  std::vector<std::vector<int64_t>> groups;  // entries (global rows) per bucket; one group without buckets
  const bool is_index = ends_with(path, ".json");
  if (is_index) {
    int64_t from_file = 0;
    IndexV2 idx = read_index_v2(path, opt.max_index_entries, &from_file);
    if (opt.log && from_file > 0)
      spdlog::info("image_text_shards: {}: its indices_file holds {} entries (~{} MB of memory at setup; limit: max_index_entries {})",
                   path, from_file, from_file * 100 / 1000000, opt.max_index_entries);
    paths_ = idx.arrow_files;
    cum = idx.cum_length;
    if (idx.multireso) {
      for (IndexV2::Bucket& b : idx.buckets) {
        buckets_.push_back({b.width, b.height});
        groups.push_back(std::move(b.indices));
      }
    } else {
      groups.push_back(std::move(idx.indices));
    }
  } else {
    paths_ = path.find_first_of("*?[") != std::string::npos ? glob_paths(path) : std::vector<std::string>{path};
    if (paths_.empty()) throw std::runtime_error(path + ": no Arrow file matches (the path is relative to the current folder)");
  }
  // Each open file holds a descriptor (and a mapping) for the run: raise the soft limit of open
  // files toward the hard one where the default (often 1024) is too few, or say so.
  {
    rlimit lim{};
    const rlim_t need = static_cast<rlim_t>(paths_.size()) + 256;  // and the run's own files
    if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur < need) {
      lim.rlim_cur = lim.rlim_max == RLIM_INFINITY ? need : std::min(need, lim.rlim_max);
      setrlimit(RLIMIT_NOFILE, &lim);
      if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < need)
        throw std::runtime_error(path + ": its " + std::to_string(paths_.size()) + " Arrow files stay open (memory-mapped) for the run, but this "
                                 "process may open " + std::to_string(lim.rlim_cur) + " files (ulimit -n; the hard limit is " +
                                 std::to_string(lim.rlim_max) + "): raise it, or write fewer, larger files");
    }
  }
  // Open every file: it exists, is whole, holds the rows the index says, and has the columns.
  std::vector<std::pair<int, int>> size_cols;  // per file: the width and height columns (-1: none), for setup
  for (size_t k = 0; k < paths_.size(); ++k) {
    const std::string& p = paths_[k];
    std::error_code ec;
    if (!fs::exists(p, ec))
      throw std::runtime_error(is_index ? path + ": arrow_files[" + std::to_string(k) + "] " + p +
                                              " does not exist (a relative path is looked for beside the index, then in the current folder)"
                                        : p + ": no such Arrow file");
    arrows_.push_back(std::make_unique<ArrowFile>(p));
    const ArrowFile& f = *arrows_.back();
    const int64_t before = k == 0 ? 0 : (is_index ? cum[k - 1] : first_row_.back() + arrows_[k - 1]->rows());
    first_row_.push_back(before);
    if (is_index && f.rows() != cum[k] - before)
      throw std::runtime_error(p + ": holds " + std::to_string(f.rows()) + " rows, but " + path + " (cum_length) says " +
                               std::to_string(cum[k] - before) + ": the index was made over other files; rebuild it (idk base)");
    std::string have;
    for (const std::string& c : f.columns()) have += (have.empty() ? "" : ", ") + c;
    int img = f.column("image");
    if (img < 0) img = f.column("binary");  // IndexKits' fallback name
    if (img < 0) throw std::runtime_error(p + ": no 'image' column (it has: " + have + "); csv2arrow.py writes the image bytes there");
    if (f.kind(img) != ArrowKind::binary && f.kind(img) != ArrowKind::string)
      throw std::runtime_error(p + ": column '" + f.columns()[static_cast<size_t>(img)] + "' is " + f.type_name(img) +
                               "; expected binary (the encoded image bytes)");
    const int cap = f.column(opt.caption_column);
    if (cap < 0)
      throw std::runtime_error(p + ": no caption column '" + opt.caption_column + "' (it has: " + have +
                               "); name another with the node's caption_column");
    if (f.kind(cap) != ArrowKind::string)
      throw std::runtime_error(p + ": caption column '" + opt.caption_column + "' is " + f.type_name(cap) + "; expected string");
    for (const char* name : {"width", "height"}) {
      const int c = f.column(name);
      if (c >= 0 && f.kind(c) != ArrowKind::integer && f.kind(c) != ArrowKind::floating && f.kind(c) != ArrowKind::string)
        throw std::runtime_error(p + ": column '" + name + "' is " + f.type_name(c) + "; expected integers");
    }
    image_col_.push_back(img);
    size_cols.push_back({f.column("width"), f.column("height")});
    caption_col_.push_back(cap);
  }
  if (!is_index) {
    const int64_t rows = first_row_.back() + arrows_.back()->rows();
    groups.emplace_back(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) groups[0][static_cast<size_t>(r)] = r;
  }
  // The fingerprint of what is read, then IndexKits' repeats to whole global batches.
  hash_ = fnv1a(std::to_string(paths_.size()));
  for (size_t k = 0; k < paths_.size(); ++k) {
    std::error_code ec;
    const auto bytes = fs::file_size(paths_[k], ec);
    hash_ = fnv1a(fs::path(paths_[k]).filename().string() + " " + std::to_string(arrows_[k]->rows()) + " " +
                      std::to_string(ec ? 0 : bytes) + "\n",
                  hash_);
  }
  content_ = fnv1a("content");
  for (size_t k = 0; k < paths_.size(); ++k) {  // each file's sampled bytes and every caption (rows, not entries: no repeats)
    content_ = fnv1a(sampled_content(paths_[k]), content_);
    for (int64_t r = 0; r < arrows_[k]->rows(); ++r)
      if (!arrows_[k]->is_null(caption_col_[k], r)) content_ = fnv1a("\n", fnv1a(arrows_[k]->bytes(caption_col_[k], r), content_));
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    entries_ += static_cast<int64_t>(groups[g].size());
    if (!buckets_.empty()) hash_ = fnv1a(std::to_string(buckets_[g].w) + "x" + std::to_string(buckets_[g].h) + ":", hash_);
    for (const int64_t r : groups[g]) hash_ = fnv1a(std::to_string(r) + " ", hash_);
    if (!buckets_.empty()) groups[g] = align_indices(std::move(groups[g]), opt.align);
  }
  // The samples: each entry's file, row and size. A row without caption or image is bad now.
  std::string first_non_utf8;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const int64_t global : groups[g]) {
      const auto k = static_cast<size_t>(std::upper_bound(first_row_.begin(), first_row_.end(), global) - first_row_.begin()) - 1;
      const ArrowFile& f = *arrows_[k];
      Item it;
      it.file = static_cast<int>(k), it.row = global - first_row_[k], it.bucket = static_cast<int>(g);
      const std::string where = "row " + std::to_string(it.row);
      if (f.is_null(caption_col_[k], it.row)) {
        add_bad({paths_[k], where, "caption ('" + opt.caption_column + "') is null"}, true);
        continue;
      }
      if (f.is_null(image_col_[k], it.row)) {
        add_bad({paths_[k], where, "image is null"}, true);
        continue;
      }
      {  // the caption: counted when empty or not UTF-8, left out when shorter than asked
        const std::string text = trim_space(f.bytes(caption_col_[k], it.row));
        const bool utf8 = valid_utf8(text);
        if (!utf8 && non_utf8_captions_++ == 0) first_non_utf8 = paths_[k] + ": " + where;
        const std::string read = utf8 ? text : repair_utf8(text);  // as caption() gives it
        const int64_t chars = std::count_if(read.begin(), read.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; });
        if (chars < opt.min_caption_chars) {
          ++short_captions_;
          continue;
        }
        if (text.empty()) ++empty_captions_;
      }
      it.w = size_value(f, size_cols[k].first, it.row);
      it.h = size_value(f, size_cols[k].second, it.row);
      if (it.w <= 0 || it.h <= 0) {  // no usable size columns: the image header says
        const std::string_view head = f.bytes(image_col_[k], it.row);
        if (!probe_image_size(std::string(head.substr(0, std::min<size_t>(head.size(), 64 * 1024))), &it.w, &it.h) &&
            !probe_image_size(std::string(head), &it.w, &it.h)) {
          add_bad({paths_[k], where, "not a PNG or JPEG image (bad header), and no width/height columns"}, true);
          continue;
        }
      }
      items_.push_back(it);
    }
  }
  if (items_.empty())
    throw std::runtime_error(path + ": no good image+caption sample (" + std::to_string(bad_count()) + " bad" +
                             (short_captions_ ? ", " + std::to_string(short_captions_) + " with captions under min_caption_chars" : "") + ")");
  if (opt.log && empty_captions_)
    spdlog::warn("image_text_shards: {}: {} of {} samples have an empty caption (trained as the empty prompt); set "
                 "min_caption_chars: 1 to leave them out", path, empty_captions_, items_.size());
  if (opt.log && short_captions_)
    spdlog::info("image_text_shards: {}: {} samples left out: captions under min_caption_chars ({})", path, short_captions_,
                 opt.min_caption_chars);
  if (opt.log && non_utf8_captions_)
    spdlog::warn("image_text_shards: {}: {} captions are not UTF-8 (the first: {}); each ill-formed byte sequence reads as "
                 "U+FFFD. Re-encode them at the source (`flowrun prep arrow` repairs them as it writes)",
                 path, non_utf8_captions_, first_non_utf8);
}

std::string ArrowImageText::caption(int64_t i) const {
  const Item& it = item(i);
  return repair_utf8(trim_space(arrows_[static_cast<size_t>(it.file)]->bytes(caption_col_[static_cast<size_t>(it.file)], it.row)));
}

std::string ArrowImageText::image_bytes(int64_t i) const {
  const Item& it = item(i);
  return std::string(arrows_[static_cast<size_t>(it.file)]->bytes(image_col_[static_cast<size_t>(it.file)], it.row));
}

std::pair<std::string, std::string> ArrowImageText::place(int64_t i) const {
  const Item& it = item(i);
  return {paths_[static_cast<size_t>(it.file)], "row " + std::to_string(it.row)};
}

int64_t ArrowImageText::row(int64_t i) const { return first_row_[static_cast<size_t>(item(i).file)] + item(i).row; }

}  // namespace flowrun
