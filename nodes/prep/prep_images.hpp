// `flowrun prep images`: a folder of image + caption pairs -> WebDataset tar shards for the
// image_text_shards node.
//
//   flowrun prep images DIR OUT_PREFIX [--shard-size 1000] [--val-fraction 0.05] [--seed 1]
//
// Pairs: X.png|X.jpg|X.jpeg (any case) with X.txt beside it (the caption, whitespace trimmed),
// found recursively (hidden names skipped), sorted by X's path relative to DIR. An image
// without a caption, an empty caption, or an image that does not decode is warned about and
// skipped (counted in the summary); a caption without an image is ignored (counted). A seeded
// shuffle picks round(val_fraction * pairs) pairs (at least 1 when the fraction is > 0 and
// there are 2 or more pairs) for val; both splits keep the sorted order. Each split is cut
// into shards of shard_size samples:
//   OUT_PREFIX.train-000000.tar, OUT_PREFIX.train-000001.tar, ..., OUT_PREFIX.val-000000.tar
// holding, per sample, members KEY.EXT (the image bytes as they are; ext png or jpg) and
// KEY.txt, where KEY is X's relative path with dots in the file name replaced by '_' (so the
// WebDataset key, up to the first dot, is the whole stem). Also OUT_PREFIX.json:
//   {"samples": n, "splits": {"train": {"samples": n, "shards": k}, "val": {...}},
//    "skipped": {"no_caption": n, "bad_image": n, "empty_caption": n}, "captions_without_image": n,
//    "shard_size": n, "val_fraction": f, "seed": s, "source": DIR}
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace flowrun {

struct PrepImagesOptions {
  std::string dir, out;        // DIR, OUT_PREFIX
  int64_t shard_size = 1000;   // samples per shard, >= 1
  double val_fraction = 0.05;  // in [0, 1)
  uint64_t seed = 1;
  bool quiet = false;          // no per-item warnings on stderr
};

struct PrepImagesSummary {
  int64_t samples[2] = {0, 0};  // train, val
  int64_t shards[2] = {0, 0};
  int64_t no_caption = 0, bad_image = 0, empty_caption = 0, orphan_captions = 0;
  std::vector<std::string> shard_paths;
  double seconds = 0;
};

// The image + caption pairs under DIR by the rules above, sorted by stem (X's path relative to
// DIR, without extension). Counts (and unless quiet, warns about) images without a caption, and
// counts captions without an image. Throws std::invalid_argument when DIR is not a folder or
// holds no pair. `flowrun prep arrow` (prep_arrow.hpp) reads the same pairs.
struct ImageCaptionPair {
  std::string stem, image, caption;  // image and caption: full paths
};
std::vector<ImageCaptionPair> find_image_caption_pairs(const std::string& dir, bool quiet, int64_t* no_caption,
                                                       int64_t* orphan_captions);

// Throws std::invalid_argument for bad options or no usable pairs, std::runtime_error on write failures.
PrepImagesSummary prep_images(const PrepImagesOptions& opt);

// The command line (args after "prep images"). Exit code: 0, 2 bad usage or input, 1 write failure.
int prep_images_command(const std::vector<std::string>& args);

}  // namespace flowrun
