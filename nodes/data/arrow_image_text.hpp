// HunyuanDiT's image-text data as its users have it, for the image_text_shards node: Arrow
// files in csv2arrow.py's layout (text_zh, md5, width, height, image: the encoded bytes), under
// an IndexKits Index V2 JSON (formats/index_v2.hpp) or given as files.
//
//   path: dataset/porcelain/jsons/porcelain.json     an Index V2 (`idk base`): its rows, filtered
//                                                    and repeated as it lists them, in order
//   path: dataset/porcelain/jsons/porcelain_mb.json  a multi-resolution one (`idk multireso`):
//                                                    its buckets (node setting buckets: index)
//   path: "dataset/porcelain/arrows/*.arrow"         Arrow files (a glob): every row, in order
//
// A sample is one entry of the index (a repeated row is two samples), as in ArrowIndexV2: its
// image from column "image" (or "binary", as IndexKits falls back), its caption from the
// caption column (text_zh by default), its size from the width and height columns (read the
// image's header where they are missing or not positive). With a multi-resolution index every
// bucket's entries are first repeated as MultiResolutionBucketIndexV2 repeats them (align =
// world x batch: the last entries once more), so each bucket fills whole global batches.
//
// Checked at setup, each a std::runtime_error naming the file (and row or key): an index that
// does not parse or names rows outside its files, an Arrow file missing, cut short or damaged,
// holding another row count than the index's cum_length says, or without the image or caption
// column or with one of the wrong type. A row whose caption or image is null, or whose image
// does not decode (found at a step), is a bad sample (on_bad: skipped and counted, or an error
// naming file and row).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "data/image_text_shards.hpp"

namespace flowrun {

class ArrowFile;

class ArrowImageText : public ImageTextSource {
 public:
  struct Options {
    std::string caption_column = "text_zh";
    OnBad on_bad = OnBad::Skip;
    bool log = true;
    int64_t align = 1;  // multi-resolution: each bucket's entries repeated to a multiple of this
    int64_t min_caption_chars = 0;  // rows whose trimmed caption has fewer characters are left out
    int64_t max_index_entries = INT64_MAX;  // an index of more entries is refused (image_text_shards' max_index_entries)
  };
  // Whether `path` names Arrow data (an Index V2 .json, or .arrow files) rather than tar shards.
  static bool is_arrow_path(const std::string& path);
  ArrowImageText(const std::string& path, const Options& opt);
  ~ArrowImageText() override;

  int64_t size() const override { return static_cast<int64_t>(items_.size()); }
  ImageBucket image_size(int64_t i) const override { return {item(i).w, item(i).h}; }
  std::string caption(int64_t i) const override;
  std::string image_bytes(int64_t i) const override;
  std::pair<std::string, std::string> place(int64_t i) const override;
  const std::vector<std::string>& files() const override { return paths_; }

  // The global row (the index's numbering: rows of the files one after another) of sample i.
  int64_t row(int64_t i) const;
  // Multi-resolution index: its buckets (width x height, sorted by h/w as IndexKits sorts them)
  // and each sample's bucket. Empty / all zero otherwise.
  bool multireso() const { return !buckets_.empty(); }
  const std::vector<ImageBucket>& buckets() const { return buckets_; }
  int bucket_of(int64_t i) const { return item(i).bucket; }
  // What it reads, for the data cursor: the index's entries as it lists them (before the repeats
  // for whole global batches, which depend on world x batch, not on the data), their buckets,
  // and every file's name, rows and bytes.
  int64_t entries() const { return entries_; }
  uint64_t content_hash() const { return hash_; }
  // A hash of the bytes: each file's sampled blocks (formats/files.hpp sampled_content:
  // footer, head and 16 blocks between) and every row's caption as stored. Equal for a copy of
  // the data elsewhere (mtime and inode are not in it); another for a file changed in place.
  uint64_t content_sample() const { return content_; }
  // Captions counted at setup (entries of the index, repeats included): empty once trimmed and
  // kept (min_caption_chars 0), shorter than min_caption_chars and left out, and not UTF-8
  // (read with each ill-formed sequence as U+FFFD, formats/utf8.hpp).
  int64_t empty_captions() const { return empty_captions_; }
  int64_t short_captions() const { return short_captions_; }
  int64_t non_utf8_captions() const { return non_utf8_captions_; }

 private:
  struct Item {
    int file = 0;
    int64_t row = 0;  // in its file
    int w = 0, h = 0, bucket = 0;
  };
  const Item& item(int64_t i) const { return items_.at(static_cast<size_t>(i)); }
  std::vector<std::string> paths_;
  std::vector<std::unique_ptr<ArrowFile>> arrows_;
  std::vector<int> image_col_, caption_col_;  // per file
  std::vector<int64_t> first_row_;            // global row of each file's row 0
  std::vector<Item> items_;
  std::vector<ImageBucket> buckets_;
  int64_t entries_ = 0;
  uint64_t hash_ = 0, content_ = 0;
  int64_t empty_captions_ = 0, short_captions_ = 0, non_utf8_captions_ = 0;
};

}  // namespace flowrun
