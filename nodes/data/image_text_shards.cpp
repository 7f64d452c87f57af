// image_text_shards: batches of images and captions from WebDataset tar shards (made by
// `flowrun prep images`). Schema: schemas/image_text_shards.yaml. Test:
// tests/nodes/image_text_shards_test.cpp. Indexing, bad samples, buckets and order: image_text_shards.hpp.
#include "data/image_text_shards.hpp"

#include <spdlog/spdlog.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <unordered_map>

#include "parallel/mesh.hpp"
#include "common/batch_keys.hpp"
#include "common/device.hpp"
#include "common/memory.hpp"
#include "common/seed.hpp"
#include "data/arrow_image_text.hpp"
#include "data/cursor.hpp"
#include "data/image_tensor.hpp"
#include "data/shuffle.hpp"
#include "formats/files.hpp"
#include "hash.hpp"
#include "registry.hpp"

namespace fs = std::filesystem;

namespace flowrun {

namespace {
constexpr uint64_t kProbeBytes = 64 * 1024;

std::string lower(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}
bool is_image_ext(const std::string& e) { return e == "png" || e == "jpg" || e == "jpeg"; }
}  // namespace

// ---- buckets ---------------------------------------------------------------------------------

BucketSpec::Kind BucketSpec::parse_kind(const std::string& s) {
  if (s == "none") return Kind::none;
  if (s == "index") return Kind::index;
  if (s == "ratios") return Kind::ratios;
  if (s == "step") return Kind::step;
  if (s == "list") return Kind::list;
  throw std::invalid_argument("buckets '" + s + "': expected none, ratios, step, list or index");
}

ImageBucket BucketSpec::parse_size(const std::string& s) {
  const size_t x = s.find('x');
  ImageBucket b;
  try {
    size_t used_w = 0, used_h = 0;
    if (x == std::string::npos) throw std::invalid_argument("no x");
    b.w = std::stoi(s.substr(0, x), &used_w);
    b.h = std::stoi(s.substr(x + 1), &used_h);
    if (used_w != x || used_h != s.size() - x - 1) throw std::invalid_argument("trailing text");
  } catch (const std::exception&) {
    throw std::invalid_argument("bucket size '" + s + "': expected WIDTHxHEIGHT, e.g. 1280x768");
  }
  if (b.w < 8 || b.h < 8) throw std::invalid_argument("bucket size '" + s + "': width and height must be at least 8");
  return b;
}

std::vector<ImageBucket> image_buckets(const BucketSpec& spec) {
  const int size = spec.size;
  if (size < 1) throw std::invalid_argument("image size must be >= 1");
  // A setting for another kind is refused, not ignored (issue 47: bucket_sizes with buckets: step).
  if (!spec.sizes.empty() && spec.kind != BucketSpec::Kind::list)
    throw std::invalid_argument("bucket_sizes is given, but buckets is not list: set buckets: list to use those sizes, "
                                "or drop bucket_sizes");
  std::vector<ImageBucket> out;
  auto add = [&](ImageBucket b) {  // duplicates dropped: an image could never reach the second
    if (std::none_of(out.begin(), out.end(), [&](const ImageBucket& o) { return o.w == b.w && o.h == b.h; })) out.push_back(b);
  };
  switch (spec.kind) {
    case BucketSpec::Kind::none:
      return {{size, size}};
    case BucketSpec::Kind::ratios: {
      auto align = [](double v) { return std::max(16, static_cast<int>(std::lround(v / 16.0)) * 16); };
      add({size, size});
      for (double r : {4.0 / 3.0, 3.0 / 4.0, 16.0 / 9.0, 9.0 / 16.0}) add({align(size * std::sqrt(r)), align(size / std::sqrt(r))});
      return out;
    }
    case BucketSpec::Kind::step: {
      const int step = spec.step, al = spec.align;
      if (step < 1 || step > size / 2)
        throw std::invalid_argument("bucket_step " + std::to_string(step) + ": must be between 1 and size / 2 (" +
                                    std::to_string(size / 2) + ")");
      if (al < 1 || al > step || size % al != 0)
        throw std::invalid_argument("bucket_align " + std::to_string(al) + ": must be at most bucket_step (" +
                                    std::to_string(step) + ") and divide size (" + std::to_string(size) + ")");
      const int lo = size / 2, hi = size * 2;
      std::vector<ImageBucket> all = {{size, size}};
      for (int dir : {1, -1}) {  // taller and narrower, then wider and flatter
        int h = size, w = size;
        while (!(dir > 0 ? h >= hi && w <= lo : h <= lo && w >= hi)) {
          h = dir > 0 ? std::min(h + step, hi) : std::max(h - step, lo);
          w = dir > 0 ? std::max(w - step, lo) : std::min(w + step, hi);
          all.push_back({w / al * al, h / al * al});
        }
      }
      std::stable_sort(all.begin(), all.end(), [](const ImageBucket& a, const ImageBucket& b) {
        return static_cast<double>(a.h) / a.w < static_cast<double>(b.h) / b.w;
      });
      for (const ImageBucket& b : all) add(b);
      return out;
    }
    case BucketSpec::Kind::index:
      throw std::invalid_argument("buckets index: the sizes are a multi-resolution index's (path: an `idk multireso` JSON)");
    case BucketSpec::Kind::list:
      if (spec.sizes.empty()) throw std::invalid_argument("buckets list: bucket_sizes is empty; give sizes such as 1024x1024");
      for (const ImageBucket& b : spec.sizes) add(b);
      return out;
  }
  return out;
}

int nearest_bucket(const std::vector<ImageBucket>& buckets, int w, int h, BucketSpec::Kind kind) {
  const bool log_ratio = kind == BucketSpec::Kind::ratios || kind == BucketSpec::Kind::none;
  auto ratio = [&](double bw, double bh) { return log_ratio ? std::log(bw / bh) : bh / bw; };
  const double r = ratio(w, h);
  int best = 0;
  double best_d = 1e300;
  for (size_t i = 0; i < buckets.size(); ++i) {
    const double d = std::abs(r - ratio(buckets[i].w, buckets[i].h));
    if (d < best_d - 1e-12) best_d = d, best = static_cast<int>(i);
  }
  return best;
}

// ---- shards ----------------------------------------------------------------------------------

std::vector<std::string> ImageTextShards::shard_paths(const std::string& prefix, const std::string& split) {
  const fs::path p(prefix);
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  const std::string head = p.filename().string() + "." + split + "-";
  std::vector<std::string> out;
  std::error_code ec;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() <= head.size() + 4 || name.compare(0, head.size(), head) != 0 || name.compare(name.size() - 4, 4, ".tar") != 0) continue;
    const std::string mid = name.substr(head.size(), name.size() - head.size() - 4);
    if (mid.find_first_not_of("0123456789") != std::string::npos) continue;
    out.push_back((p.has_parent_path() ? (dir / name).string() : name));
  }
  std::sort(out.begin(), out.end());
  return out;
}

// ---- bad samples, whatever the source -------------------------------------------------------

void ImageTextSource::add_bad(BadSample b, bool at_setup) const {
  if (on_bad_ == OnBad::Error)
    throw std::runtime_error(who_ + ": " + b.message() + " (on_bad: error; on_bad: skip leaves such samples out)");
  const int64_t n = ++bad_count_;
  if (log_)
    spdlog::warn("{}: {}: {}: {}; skipped ({} bad sample{} so far{})", who_, b.shard, b.member, b.reason, n, n == 1 ? "" : "s",
                 at_setup ? "" : ", replaced by the next good one");
  std::lock_guard<std::mutex> lock(mu_);
  bad_.push_back(std::move(b));
}

std::vector<BadSample> ImageTextSource::bad() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bad_;
}

Image ImageTextSource::decode(int64_t i) const {
  const auto [file, member] = place(i);
  std::string bytes;
  try {
    bytes = image_bytes(i);
  } catch (const std::runtime_error& e) {
    throw ImageError(e.what());
  }
  return decode_image(bytes, file + ": " + member, alpha_);
}

int64_t ImageTextSource::load(int64_t i, const std::vector<int64_t>& pool, Image* img) const {
  const auto it = std::lower_bound(pool.begin(), pool.end(), i);
  if (it == pool.end() || *it != i) throw std::logic_error(who_ + ": sample not in its pool");
  const size_t start = static_cast<size_t>(it - pool.begin()), n = pool.size();
  for (size_t k = 0; k < n; ++k) {
    const int64_t j = pool[(start + k) % n];
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (bad_at_decode_.count(j)) continue;
    }
    try {
      *img = decode(j);
      return j;
    } catch (const ImageError& e) {
      const auto [file, member] = place(j);
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!bad_at_decode_.insert(j).second) continue;  // another thread found it first
      }
      std::string reason = e.what();
      const std::string head = file + ": " + member + ": ";
      if (reason.rfind(head, 0) == 0) reason = reason.substr(head.size());
      add_bad({file, member, reason}, false);  // throws with on_bad: error
    }
  }
  throw std::runtime_error(who_ + ": every image of a bucket of split '" + split_ + "' failed to decode");
}

// ---- shards ----------------------------------------------------------------------------------

ImageTextShards::ImageTextShards(const std::string& prefix, const std::string& split, OnBad on_bad, bool log)
    : ImageTextSource("image_text_shards", split, on_bad, log) {
  paths_ = shard_paths(prefix, split);
  if (paths_.empty())
    throw std::runtime_error("no image-text shards at " + prefix + "." + split + "-*.tar (path is relative to the current folder; make them "
                             "with `flowrun prep images DIR " + prefix + "`)");
  for (size_t s = 0; s < paths_.size(); ++s) {
    files_.push_back(std::make_unique<TarFile>(paths_[s]));
    const TarFile& f = *files_.back();
    const TarIndex& idx = f.index();
    // Members -> samples by key, in order of first appearance.
    struct Group {
      std::string key;
      std::vector<const TarMember*> images, captions;
    };
    std::vector<Group> groups;
    std::unordered_map<std::string, size_t> by_key;
    for (const TarMember& m : idx.members) {
      const std::string key = tar_key(m.name), ext = lower(tar_ext(m.name));
      auto [it, fresh] = by_key.emplace(key, groups.size());
      if (fresh) groups.push_back({key, {}, {}});
      Group& g = groups[it->second];
      if (is_image_ext(ext)) g.images.push_back(&m);
      else if (ext == "txt") g.captions.push_back(&m);
    }
    const std::string truncated_key = idx.truncated.empty() ? "" : tar_key(idx.truncated);
    bool truncated_reported = false;
    for (const Group& g : groups) {
      const std::string first = g.images.empty() ? (g.captions.empty() ? g.key : g.captions[0]->name) : g.images[0]->name;
      if (!truncated_key.empty() && g.key == truncated_key) {
        add_bad({paths_[s], idx.truncated, "member cut short (the file ends inside it)"}, true);
        truncated_reported = true;
      } else if (g.images.empty()) {
        add_bad({paths_[s], first, "no image (png, jpg or jpeg) with this key"}, true);
      } else if (g.images.size() > 1) {
        add_bad({paths_[s], first, "more than one image with this key"}, true);
      } else if (g.captions.size() != 1) {
        add_bad({paths_[s], first, g.captions.empty() ? "no caption (" + g.key + ".txt)" : "more than one caption"}, true);
      } else {
        ImageTextSample smp;
        smp.shard = static_cast<int>(s), smp.key = g.key, smp.image = *g.images[0], smp.caption = *g.captions[0];
        std::string head = f.read_prefix(smp.image, kProbeBytes);
        bool ok = probe_image_size(head, &smp.w, &smp.h);
        if (!ok && smp.image.size > kProbeBytes && !sniff_image_format(head).empty())
          head = f.read(smp.image), ok = probe_image_size(head, &smp.w, &smp.h);  // a JPEG with big metadata first
        if (!ok) {
          add_bad({paths_[s], smp.image.name, "not a PNG or JPEG image (bad header)"}, true);
          continue;
        }
        samples_.push_back(std::move(smp));
      }
    }
    if (!idx.truncated.empty() && !truncated_reported)
      add_bad({paths_[s], idx.truncated, "member cut short (the file ends inside it)"}, true);
    if (!idx.error.empty()) add_bad({paths_[s], "(the rest of the shard)", idx.error}, true);
  }
  if (samples_.empty())
    throw std::runtime_error("image_text_shards: " + prefix + "." + split + "-*.tar (" + std::to_string(paths_.size()) +
                             " shards) hold no good image+caption sample (" + std::to_string(bad_count()) + " bad)");
  if (log_ && bad_count() > 0)
    spdlog::warn("image_text_shards: {}.{}: {} bad sample{} left out, {} good", prefix, split, bad_count(), bad_count() == 1 ? "" : "s",
                 samples_.size());
}

std::string ImageTextShards::caption(int64_t i) const {
  const ImageTextSample& s = sample(i);
  return trim_space(files_[static_cast<size_t>(s.shard)]->read(s.caption));
}

std::string ImageTextShards::image_bytes(int64_t i) const {
  const ImageTextSample& s = sample(i);
  return files_[static_cast<size_t>(s.shard)]->read(s.image);
}

TensorMap load_image_batch(const ImageTextSource& data, const std::vector<int64_t>& ids, const std::vector<int64_t>& pool, int w, int h,
                           const std::vector<char>& flips, std::vector<std::string>* captions) {
  const auto n = static_cast<int64_t>(ids.size());
  torch::Tensor out = torch::empty({n, 3, h, w}, torch::kFloat32);
  torch::Tensor meta = torch::empty({n, 6}, torch::kFloat32);
  std::vector<int64_t> used(ids.size());
  tbb::parallel_for(int64_t(0), n, [&](int64_t j) {
    Image img;
    used[static_cast<size_t>(j)] = data.load(ids[static_cast<size_t>(j)], pool, &img);
    const CenterCrop c = center_crop_box(img.w, img.h, w, h);
    float* m = meta[j].data_ptr<float>();
    m[0] = static_cast<float>(img.h), m[1] = static_cast<float>(img.w), m[2] = static_cast<float>(h);
    m[3] = static_cast<float>(w), m[4] = static_cast<float>(c.top), m[5] = static_cast<float>(c.left);
    img = resize_center_crop(img, w, h);
    if (!flips.empty() && flips[static_cast<size_t>(j)]) img = hflip(img);
    out[j].copy_(image_to_tensor(img));
  });
  if (captions) {
    captions->clear();
    for (int64_t id : used) captions->push_back(data.caption(id));
  }
  return {{"image", out}, {batch_key::image_meta_size, meta}, {batch_key::style, torch::zeros({n}, torch::kLong)}};
}

// ---- training order --------------------------------------------------------------------------

ImageTextSampler::ImageTextSampler(std::vector<int> bucket_of, int buckets, int64_t batch, uint64_t seed)
    : bucket_of_(std::move(bucket_of)), pools_(static_cast<size_t>(std::max(buckets, 1))), batch_(batch), seed_(seed) {
  if (batch < 1) throw std::invalid_argument("batch must be >= 1");
  for (size_t i = 0; i < bucket_of_.size(); ++i) {
    const int b = bucket_of_[i];
    if (b < 0 || b >= static_cast<int>(pools_.size())) throw std::invalid_argument("sample bucket out of range");
    pools_[static_cast<size_t>(b)].push_back(static_cast<int64_t>(i));
  }
}

int64_t ImageTextSampler::steps_per_epoch(int world) const {
  const int64_t per_step = batch_ * world;
  int64_t steps = 0;
  std::string counts;
  for (const auto& p : pools_) {
    steps += static_cast<int64_t>(p.size()) / per_step;
    counts += (counts.empty() ? "" : ", ") + std::to_string(p.size());
  }
  if (steps == 0)
    throw std::runtime_error("image_text_shards: " + std::to_string(bucket_of_.size()) + " good samples (per bucket: " + counts +
                             ") but one step needs world x batch = " + std::to_string(world) + " x " + std::to_string(batch_) + " = " +
                             std::to_string(per_step) + " of one bucket: use a smaller batch, or more images");
  return steps;
}

std::pair<int, std::vector<int64_t>> ImageTextSampler::for_step(int64_t step, int rank, int world) const {
  if (step < 1) throw std::invalid_argument("steps are 1-based; got " + std::to_string(step));
  if (world < 1 || rank < 0 || rank >= world)
    throw std::invalid_argument("rank " + std::to_string(rank) + " is not in a world of " + std::to_string(world));
  const int64_t spe = steps_per_epoch(world), epoch = (step - 1) / spe, k = (step - 1) % spe;
  const int64_t per_step = batch_ * world;
  std::lock_guard<std::mutex> lock(mu_);
  if (epoch != cached_epoch_ || world != cached_world_) {
    const std::vector<int64_t> perm =
        seeded_permutation(static_cast<int64_t>(bucket_of_.size()), mix_seed({seed_, kSeedTagEpoch, static_cast<uint64_t>(epoch)}));
    std::vector<std::vector<int64_t>> by_bucket(pools_.size());
    for (int64_t i : perm) by_bucket[static_cast<size_t>(bucket_of_[static_cast<size_t>(i)])].push_back(i);
    global_.clear();
    for (size_t b = 0; b < by_bucket.size(); ++b)
      for (size_t first = 0; first + static_cast<size_t>(per_step) <= by_bucket[b].size(); first += static_cast<size_t>(per_step))
        global_.emplace_back(static_cast<int>(b), std::vector<int64_t>(by_bucket[b].begin() + static_cast<int64_t>(first),
                                                                        by_bucket[b].begin() + static_cast<int64_t>(first) + per_step));
    if (pools_.size() > 1) {
      const std::vector<int64_t> order =
          seeded_permutation(static_cast<int64_t>(global_.size()), mix_seed({seed_, kSeedTagBuckets, static_cast<uint64_t>(epoch)}));
      std::vector<std::pair<int, std::vector<int64_t>>> shuffled;
      shuffled.reserve(global_.size());
      for (int64_t o : order) shuffled.push_back(std::move(global_[static_cast<size_t>(o)]));
      global_ = std::move(shuffled);
    }
    cached_epoch_ = epoch, cached_world_ = world;
  }
  const auto& g = global_.at(static_cast<size_t>(k));
  const int64_t first = static_cast<int64_t>(rank) * batch_;
  return {g.first, std::vector<int64_t>(g.second.begin() + first, g.second.begin() + first + batch_)};
}

bool ImageTextSampler::flip(int64_t step, int64_t row) const {
  return (mix_seed({seed_, kSeedTagFlip, static_cast<uint64_t>(step), static_cast<uint64_t>(row)}) >> 11) & 1;
}

// ---- dataset state ---------------------------------------------------------------------------

ImageTextDataset::ImageTextDataset(std::vector<std::pair<std::string, std::shared_ptr<const ImageTextSource>>> splits, int size)
    : splits_(std::move(splits)), size_(size) {
  for (const auto& [name, s] : splits_) {
    std::vector<int64_t> all(static_cast<size_t>(s->size()));
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
    all_.push_back(std::move(all));
  }
}

std::vector<std::string> ImageTextDataset::splits() const {
  std::vector<std::string> names;
  for (const auto& [name, s] : splits_) names.push_back(name);
  return names;
}

size_t ImageTextDataset::find(const std::string& split) const {
  for (size_t i = 0; i < splits_.size(); ++i)
    if (splits_[i].first == split) return i;
  std::string have;
  for (const auto& [name, s] : splits_) have += (have.empty() ? "" : ", ") + name;
  throw std::invalid_argument("image_text_shards dataset: no split '" + split + "' (have: " + have +
                              "; a split is there when PREFIX." + split + "-*.tar exist)");
}

const ImageTextSource& ImageTextDataset::source(const std::string& split) const { return *splits_[find(split)].second; }

int64_t ImageTextDataset::num_batches(const std::string& split, int64_t batch, int rank, int world) const {
  return fixed_pass_batches(source(split).size(), batch, rank, world, "image_text_shards dataset");
}

std::vector<int64_t> ImageTextDataset::ids(const std::string& split, int64_t index, int64_t batch, int rank, int world) const {
  return fixed_pass_rows(source(split).size(), split, index, batch, rank, world, "image_text_shards dataset");
}

TensorMap ImageTextDataset::batch(const std::string& split, int64_t index, int64_t batch, int rank, int world) const {
  const size_t s = find(split);
  return load_image_batch(*splits_[s].second, ids(split, index, batch, rank, world), all_[s], size_, size_, {}, nullptr);
}

std::vector<std::string> ImageTextDataset::captions(const std::string& split, int64_t index, int64_t batch, int rank, int world) const {
  const size_t s = find(split);
  std::vector<std::string> caps;
  const ImageTextSource& d = *splits_[s].second;
  // The same replacements as batch() (a bad image's row shows the next good sample).
  for (int64_t id : ids(split, index, batch, rank, world)) {
    Image img;
    caps.push_back(d.caption(d.load(id, all_[s], &img)));
  }
  return caps;
}

// ---- the node --------------------------------------------------------------------------------

namespace {

// What the cursor reads: the samples, over a hash of each one's shard (its name), key, member
// sizes and image size (a shard added, removed or replaced changes it).
DataFingerprint fingerprint(const ImageTextSource& source) {
  if (const auto* arrow = dynamic_cast<const ArrowImageText*>(&source))
    return {arrow->entries(), static_cast<int64_t>(arrow->files().size()), static_cast<int64_t>(arrow->content_hash()),
            static_cast<int64_t>(arrow->content_sample())};
  const auto& d = dynamic_cast<const ImageTextShards&>(source);
  uint64_t h = fnv1a(std::to_string(d.size()));
  for (int64_t i = 0; i < d.size(); ++i) {
    const ImageTextSample& s = d.sample(i);
    const std::string shard = std::filesystem::path(d.shards().at(static_cast<size_t>(s.shard))).filename().string();
    h = fnv1a(shard + "/" + s.key + " " + std::to_string(s.image.size) + " " + std::to_string(s.caption.size) + " " +
                  std::to_string(s.w) + "x" + std::to_string(s.h) + "\n",
              h);
  }
  uint64_t content = fnv1a("content");  // each shard's sampled bytes (a shard changed in place at equal size)
  for (const std::string& shard : d.shards()) content = fnv1a(sampled_content(shard), content);
  return {d.size(), static_cast<int64_t>(d.shards().size()), static_cast<int64_t>(h), static_cast<int64_t>(content)};
}

class ImageTextShardsNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const Params& p = ctx.params();
    const std::string path = p.get<std::string>("path"), split = p.get<std::string>("split");
    const int size = static_cast<int>(p.get<int64_t>("size"));
    const int64_t batch = p.get<int64_t>("batch");
    const bool arrow = ArrowImageText::is_arrow_path(path);
    BucketSpec spec;
    spec.size = size;
    try {
      spec.kind = BucketSpec::parse_kind(p.get<std::string>("buckets"));
      spec.step = static_cast<int>(p.get<int64_t>("bucket_step"));
      spec.align = static_cast<int>(p.get<int64_t>("bucket_align"));
      for (const auto& v : p.get<std::vector<std::string>>("bucket_sizes")) spec.sizes.push_back(BucketSpec::parse_size(v));
      if (spec.kind != BucketSpec::Kind::index) buckets_ = image_buckets(spec);
      else if (!spec.sizes.empty())
        throw std::invalid_argument("bucket_sizes is given, but buckets is index (the index's sizes): drop bucket_sizes");
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(ctx.who() + ": " + e.what());
    }
    // Settings that only Arrow data has, refused elsewhere rather than ignored.
    const std::optional<std::string> caption_column =
        p.has("caption_column") ? std::optional<std::string>(p.get<std::string>("caption_column")) : std::nullopt;
    if (!arrow && caption_column)
      throw std::runtime_error(ctx.who() + ": caption_column is for Arrow data (path: an Index V2 .json or .arrow files); tar shards "
                               "hold captions as KEY.txt: drop it");
    const int64_t min_caption_chars = p.get<int64_t>("min_caption_chars");
    if (!arrow && min_caption_chars > 0)
      throw std::runtime_error(ctx.who() + ": min_caption_chars is for Arrow data (path: an Index V2 .json or .arrow files); tar "
                               "shards made by `flowrun prep images` hold no empty caption: drop it");
    if (!arrow && spec.kind == BucketSpec::Kind::index)
      throw std::runtime_error(ctx.who() + ": buckets: index takes the buckets of a multi-resolution Index V2 (path: the JSON `idk "
                               "multireso` made); " + path + " names tar shards: use ratios, step or list");
    if (arrow && split != "train")
      throw std::runtime_error(ctx.who() + ": split '" + split + "': an Index V2 or Arrow files are one split (train); name the "
                               "held-out data's index in another node");
    flip_ = p.get<bool>("flip");
    const uint64_t seed = node_seed(ctx);
    const OnBad mode = p.get<std::string>("on_bad") == "error" ? OnBad::Error : OnBad::Skip;  // the schema's enum
    const parallel::Replica replica = parallel::replica_of(ctx.run());  // the tp ranks of a replica read the same batches
    rank_ = replica.index, world_ = replica.count;

    std::shared_ptr<const ArrowImageText> arrow_data;
    if (arrow) {
      ArrowImageText::Options o;
      o.caption_column = caption_column.value_or("text_zh");
      o.on_bad = mode;
      o.min_caption_chars = min_caption_chars;
      o.max_index_entries = p.get<int64_t>("max_index_entries");
      // IndexKits' MultiResolutionBucketIndexV2 repeats each bucket's entries to whole global batches.
      o.align = spec.kind == BucketSpec::Kind::index ? batch * world_ : 1;
      try {
        arrow_data = std::make_shared<const ArrowImageText>(path, o);
      } catch (const std::runtime_error& e) {
        throw std::runtime_error(ctx.who() + ": " + e.what());
      }
      if (arrow_data->multireso() && spec.kind != BucketSpec::Kind::index)
        throw std::runtime_error(ctx.who() + ": " + path + " is a multi-resolution index (`idk multireso`: its rows are in " +
                                 std::to_string(arrow_data->buckets().size()) + " size buckets): set buckets: index to train in them, "
                                 "or point path at the base index it was made from");
      if (!arrow_data->multireso() && spec.kind == BucketSpec::Kind::index)
        throw std::runtime_error(ctx.who() + ": buckets: index, but " + path + " is not a multi-resolution index (make one with `idk "
                                 "multireso --src " + path + " ...`), or use ratios, step or list");
      if (spec.kind == BucketSpec::Kind::index) buckets_ = arrow_data->buckets();
      data_ = arrow_data;
    }
    const bool multi = spec.kind != BucketSpec::Kind::none;
    {  // the largest batch it makes (its largest bucket), before reading any image
      double pixels = 0;
      for (const ImageBucket& b : buckets_) pixels = std::max(pixels, static_cast<double>(b.w) * b.h);
      check_batch_fits(ctx.who(), std::to_string(batch) + " images of up to " + std::to_string(static_cast<int64_t>(pixels)) +
                                      " pixels, 3 channels, float32",
                       static_cast<double>(batch) * 3 * pixels * 4);
    }
    if (!arrow) data_ = std::make_shared<const ImageTextShards>(path, split, mode);
    std::vector<int> bucket_of(static_cast<size_t>(data_->size()));
    std::vector<int64_t> per(buckets_.size(), 0);
    for (int64_t i = 0; i < data_->size(); ++i) {
      const ImageBucket s = data_->image_size(i);
      int& b = bucket_of[static_cast<size_t>(i)];
      b = spec.kind == BucketSpec::Kind::index ? arrow_data->bucket_of(i) : multi ? nearest_bucket(buckets_, s.w, s.h, spec.kind) : 0;
      ++per[static_cast<size_t>(b)];
    }
    sampler_ = std::make_unique<ImageTextSampler>(std::move(bucket_of), static_cast<int>(buckets_.size()), batch, seed);
    const int64_t spe = sampler_->steps_per_epoch(world_);  // fail now, not at step 1, if too few samples
    log_histogram(ctx, arrow ? path : path + "." + split, per, batch * world_, spe);

    std::vector<std::pair<std::string, std::shared_ptr<const ImageTextSource>>> splits;
    for (const char* name : {"train", "val"}) {
      if (name == split)
        splits.emplace_back(name, data_);
      else if (!arrow && ImageTextShards::exists(path, name))
        splits.emplace_back(name, std::make_shared<const ImageTextShards>(path, name, mode));
    }
    ctx.own_state("dataset", std::shared_ptr<Dataset>(std::make_shared<ImageTextDataset>(std::move(splits), size)));
    auto cursor = std::make_shared<DataCursor>();
    cursor->data = fingerprint(*data_);
    cursor->refuse_changed = p.get<std::string>("on_data_change") == "refuse";
    ctx.own_state("cursor", cursor);
  }

  void run(StepContext& ctx) override {
    DataCursor& cursor = ctx.state_as<DataCursor>("cursor");
    cursor.expect_step(ctx.step());
    const auto [bucket, ids] = sampler_->for_step(ctx.step(), rank_, world_);
    std::vector<char> flips(ids.size(), 0);
    if (flip_)
      for (size_t j = 0; j < ids.size(); ++j)
        flips[j] = sampler_->flip(ctx.step(), static_cast<int64_t>(rank_) * sampler_->batch_size() + static_cast<int64_t>(j));
    std::vector<std::string> captions;
    const ImageBucket& b = buckets_[static_cast<size_t>(bucket)];
    TensorMap batch = load_image_batch(*data_, ids, sampler_->pool(bucket), b.w, b.h, flips, &captions);
    ctx.out("batch", to_device(batch, run_device(ctx.run())));
    ctx.out("captions", std::move(captions));
    ctx.out("skipped", data_->bad_count());
    cursor.batches = ctx.step();
  }

 private:
  std::shared_ptr<const ImageTextSource> data_;
  // The data set's bucket histogram, at setup: samples per size (the sizes no sample reaches
  // left out, counted), and the buckets with fewer samples than a global batch, which an epoch
  // never trains on (their samples dropped with each bucket's remainder).
  void log_histogram(SetupContext& ctx, const std::string& what, const std::vector<int64_t>& per, int64_t global,
                     int64_t steps_per_epoch) const {
    if (ctx.run().rank != 0) return;
    std::string sizes, unused;
    int64_t empty = 0;
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const std::string name = std::to_string(buckets_[b].w) + "x" + std::to_string(buckets_[b].h);
      if (per[b] == 0) {
        ++empty;
        continue;
      }
      sizes += (sizes.empty() ? "" : ", ") + name + ": " + std::to_string(per[b]);
      if (per[b] < global) unused += (unused.empty() ? "" : ", ") + name + " (" + std::to_string(per[b]) + ")";
    }
    spdlog::info("{}: {}: {} samples in {} files, {} steps per epoch; samples per size: {}{}", ctx.who(), what,
                 data_->size(), data_->files().size(), steps_per_epoch, sizes,
                 empty ? fmt::format(" ({} of the {} sizes without samples)", empty, buckets_.size()) : std::string());
    if (!unused.empty())
      spdlog::warn("{}: sizes with fewer samples than a global batch of {}, so never trained on: {}", ctx.who(), global,
                   unused);
  }

  std::vector<ImageBucket> buckets_;
  std::unique_ptr<ImageTextSampler> sampler_;
  bool flip_ = false;
  int rank_ = 0, world_ = 1;
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(image_text_shards, flowrun::ImageTextShardsNode)
