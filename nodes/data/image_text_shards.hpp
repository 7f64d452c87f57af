// The pieces behind the image_text_shards node, usable on their own (tests, samplers, tools).
//
// Shards: PREFIX.SPLIT-NNNNNN.tar (made by `flowrun prep images`), WebDataset layout: a sample
// is the members sharing a key (tar.hpp), one image (png, jpg or jpeg) and one caption (txt).
// At setup every shard's headers are indexed (member offsets), and each image's header is read
// (its first 64 KiB) for its size, so a step reads exactly its samples with pread.
//
// Bad samples: found at setup (no caption, no image, two images, an image that is not PNG/JPEG
// by its header, a member cut short by the end of the file, a corrupt tar header: the rest of
// that shard) or when decoding at a step (a corrupt image body). With on_bad = error the node
// throws, naming the shard and member; with skip it warns once per bad sample and counts it.
// A sample found bad at setup is not in the order at all. One found bad while decoding is
// replaced by the next good sample of the same bucket in file order (wrapping), so the batch of
// a step still depends only on (data, seed, step, rank, world).
//
// Sizes: without buckets every image is scaled to cover size x size and centre-cropped. With
// buckets (HunyuanDiT's multi-resolution training, BucketSpec below) each image goes to the
// bucket whose aspect ratio is nearest its own and is scaled to cover it and centre-cropped:
//   - ratios: for w:h in {1:1, 4:3, 3:4, 16:9, 9:16}, w x h = size*sqrt(r) x size/sqrt(r)
//     rounded to multiples of 16 (area ~ size^2; the 1:1 bucket is exactly size x size;
//     duplicates dropped, so small sizes have fewer buckets: 32 gives 32x32, 48x32, 32x48);
//     nearest in log ratio;
//   - step: the resolution group of Hunyuan's training code (ResolutionGroup(base_size=size,
//     step, align), calc_by_step): from size x size, the height grows by `step` up to 2 size
//     while the width shrinks by `step` down to size / 2, and the other way round, each size
//     rounded down to a multiple of `align`, sorted by h/w (1024, 64, 16: 33 sizes from
//     2048x512 to 512x2048); nearest in h/w, as its data loader picks (the first on a tie);
//   - list: the sizes given (e.g. the HunyuanDiT pipeline's 1024x1024, 1280x768, 768x1280,
//     1152x864, ...), nearest in h/w.
//
// Order: epoch e takes a seeded shuffle of the good samples (seed mix(seed, "epoch", e)),
// splits it by bucket keeping that order, and cuts each bucket's list into global batches of
// world x batch samples (a bucket's remainder is dropped for the epoch). Without buckets the
// global batches are taken in order; with buckets their order is shuffled again
// (mix(seed, "buckets", e)), so a global batch, and so every rank's batch, holds one bucket's
// size. Rank r takes rows [r*batch, (r+1)*batch) of the step's global batch. Steps per epoch =
// sum over buckets of floor(samples in bucket / (world x batch)). Random flips are drawn per
// global row: mix(seed, "flip", step, r*batch + j), so world 2 x batch B reads exactly what
// world 1 x batch 2B reads.
#pragma once
#include <torch/torch.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/tensor_map.hpp"
#include "data/dataset.hpp"
#include "formats/image_io.hpp"
#include "formats/tar.hpp"

namespace flowrun {

// ---- buckets ----

struct ImageBucket {
  int w = 0, h = 0;
};
// image_text_shards' `buckets` parameters (the schema's defaults there).
struct BucketSpec {
  enum class Kind { none, ratios, step, list, index };  // index: a multi-resolution index's (arrow_image_text.hpp)
  Kind kind = Kind::none;
  int size = 256;                  // none, ratios, step: the base size
  int step = 64, align = 16;       // step
  std::vector<ImageBucket> sizes;  // list
  // "none" | "ratios" | "step" | "list" | "index"; "1280x768" (width x height). Both throw
  // std::invalid_argument naming the value.
  static Kind parse_kind(const std::string& s);
  static ImageBucket parse_size(const std::string& s);
};
// The bucket sizes (none: just {size, size}); see above. Throws std::invalid_argument naming
// the setting for sizes that cannot be made (a step larger than size / 2, an empty list, ...).
std::vector<ImageBucket> image_buckets(const BucketSpec& spec);
// Index of the bucket whose aspect ratio is nearest w/h: in log ratio (ratios), or in h/w as
// Hunyuan's loader does (step, list).
int nearest_bucket(const std::vector<ImageBucket>& buckets, int w, int h, BucketSpec::Kind kind = BucketSpec::Kind::ratios);

// ---- where a split's samples come from ----

enum class OnBad { Skip, Error };

struct BadSample {
  std::string shard, member, reason;  // the file, the sample in it (a tar member, "row N"), why
  std::string message() const { return shard + ": " + member + ": " + reason; }
};

// The samples of one split, whatever holds them: tar shards (ImageTextShards, below) or Arrow
// files under an IndexKits Index V2 (ArrowImageText, data/arrow_image_text.hpp). The bad-sample
// rules above are kept here, once: a sample that fails to decode is recorded (or, on_bad error,
// thrown naming its file and place) and replaced by the next good one of its pool.
class ImageTextSource {
 public:
  virtual ~ImageTextSource() = default;
  virtual int64_t size() const = 0;
  virtual ImageBucket image_size(int64_t i) const = 0;  // width x height as stored (buckets)
  virtual std::string caption(int64_t i) const = 0;     // trimmed
  virtual std::string image_bytes(int64_t i) const = 0;
  // The file holding sample i and its place there (a tar member, "row 17").
  virtual std::pair<std::string, std::string> place(int64_t i) const = 0;
  virtual const std::vector<std::string>& files() const = 0;

  const std::string& split() const { return split_; }
  Image decode(int64_t i) const;  // throws ImageError naming the file and place
  // Decodes sample i; when it is bad (skip) the next good one of `pool` after it (wrapping),
  // where `pool` lists sample indices in ascending order and contains i. Returns the index used.
  int64_t load(int64_t i, const std::vector<int64_t>& pool, Image* img) const;
  std::vector<BadSample> bad() const;  // found at setup and while decoding so far
  int64_t bad_count() const { return bad_count_.load(); }

 protected:
  ImageTextSource(std::string who, std::string split, OnBad on_bad, bool log)
      : who_(std::move(who)), split_(std::move(split)), on_bad_(on_bad), log_(log) {}
  void add_bad(BadSample b, bool at_setup) const;  // throws with OnBad::Error
  std::string who_;  // the node type, in messages
  std::string split_;
  Alpha alpha_ = Alpha::over_white;  // a PNG's alpha channel (formats/image_io.hpp)
  OnBad on_bad_;
  bool log_;

 private:
  mutable std::mutex mu_;
  mutable std::vector<BadSample> bad_;
  mutable std::set<int64_t> bad_at_decode_;
  mutable std::atomic<int64_t> bad_count_{0};
};

// ---- one split's shards ----

struct ImageTextSample {
  int shard = 0;
  std::string key;
  TarMember image, caption;
  int w = 0, h = 0;  // from the image header
};

class ImageTextShards : public ImageTextSource {
 public:
  // Indexes PREFIX.SPLIT-*.tar. Throws std::runtime_error when there are none, when on_bad is
  // Error and a bad sample is found (naming the shard and member), or when no sample is good.
  // With Skip, bad samples are logged (a warning each) and listed in bad().
  ImageTextShards(const std::string& prefix, const std::string& split, OnBad on_bad = OnBad::Skip, bool log = true);
  static std::vector<std::string> shard_paths(const std::string& prefix, const std::string& split);
  static bool exists(const std::string& prefix, const std::string& split) { return !shard_paths(prefix, split).empty(); }

  int64_t size() const override { return static_cast<int64_t>(samples_.size()); }
  const ImageTextSample& sample(int64_t i) const { return samples_.at(static_cast<size_t>(i)); }
  const std::vector<std::string>& shards() const { return paths_; }
  const std::vector<std::string>& files() const override { return paths_; }
  ImageBucket image_size(int64_t i) const override { return {sample(i).w, sample(i).h}; }
  std::pair<std::string, std::string> place(int64_t i) const override {
    return {paths_[static_cast<size_t>(sample(i).shard)], sample(i).image.name};
  }
  std::string caption(int64_t i) const override;
  std::string image_bytes(int64_t i) const override;

 private:
  std::vector<std::string> paths_;
  std::vector<std::unique_ptr<TarFile>> files_;
  std::vector<ImageTextSample> samples_;
};

// Decodes, resizes and crops samples `ids` into {"image": float [n, 3, h, w] in [-1, 1],
// "image_meta_size": float [n, 6] = (original h, original w, h, w, crop top, crop left) as
// HunyuanDiT's size conditioning counts them (the crop in the scaled image's pixels), "style":
// int64 [n] zeros}; flips[j] mirrors row j. Decodes in parallel. `captions` (if not null) gets the captions of
// the samples actually used (after replacements).
TensorMap load_image_batch(const ImageTextSource& data, const std::vector<int64_t>& ids, const std::vector<int64_t>& pool,
                           int w, int h, const std::vector<char>& flips, std::vector<std::string>* captions);

// ---- the training order ----

class ImageTextSampler {
 public:
  // bucket_of[i]: the bucket of sample i (0 .. buckets-1).
  ImageTextSampler(std::vector<int> bucket_of, int buckets, int64_t batch, uint64_t seed);
  int64_t batch_size() const { return batch_; }
  // Throws std::runtime_error when not even one global batch exists.
  int64_t steps_per_epoch(int world) const;
  // The samples rank `rank` reads at `step` (1-based), and their bucket.
  std::pair<int, std::vector<int64_t>> for_step(int64_t step, int rank, int world) const;
  // Whether global row `row` of `step` is flipped (p = 0.5).
  bool flip(int64_t step, int64_t row) const;
  // Samples of bucket b in file order (the replacement pool for bad samples).
  const std::vector<int64_t>& pool(int b) const { return pools_.at(static_cast<size_t>(b)); }

 private:
  std::vector<int> bucket_of_;
  std::vector<std::vector<int64_t>> pools_;
  int64_t batch_;
  uint64_t seed_;
  mutable std::mutex mu_;
  mutable int64_t cached_epoch_ = -1;
  mutable int cached_world_ = 0;
  mutable std::vector<std::pair<int, std::vector<int64_t>>> global_;  // the epoch's global batches
};

// The `dataset` state: fixed passes over each split present, in file order, no flips, every
// image at size x size (buckets do not apply); batch i of rank r holds samples
// i*world*batch + r*batch + [0, batch). batch() gives {"image"}; captions() the same rows' captions.
class ImageTextDataset : public Dataset {
 public:
  ImageTextDataset(std::vector<std::pair<std::string, std::shared_ptr<const ImageTextSource>>> splits, int size);
  std::vector<std::string> splits() const override;
  int64_t num_batches(const std::string& split, int64_t batch, int rank, int world) const override;
  TensorMap batch(const std::string& split, int64_t index, int64_t batch, int rank, int world) const override;
  std::vector<std::string> captions(const std::string& split, int64_t index, int64_t batch, int rank,
                                    int world) const override;
  const ImageTextSource& source(const std::string& split) const;
  int size() const { return size_; }

 private:
  std::vector<int64_t> ids(const std::string& split, int64_t index, int64_t batch, int rank, int world) const;
  size_t find(const std::string& split) const;
  std::vector<std::pair<std::string, std::shared_ptr<const ImageTextSource>>> splits_;
  std::vector<std::vector<int64_t>> all_;  // per split: 0 .. n-1, the replacement pool
  int size_;
};

}  // namespace flowrun
