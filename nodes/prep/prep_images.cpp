// `flowrun prep images`: see prep_images.hpp.
#include "prep/prep_images.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

#include "formats/files.hpp"
#include "formats/image_io.hpp"
#include "data/shuffle.hpp"
#include "prep/cli_args.hpp"
#include "formats/tar.hpp"

namespace fs = std::filesystem;

namespace flowrun {
namespace {

const char* kImagesUsage =
    "usage: flowrun prep images DIR OUT_PREFIX [--shard-size 1000] [--val-fraction 0.05] [--seed 1]\n"
    "\n"
    "Packs image + caption pairs (X.png|X.jpg|X.jpeg with X.txt beside it; DIR is read recursively)\n"
    "into WebDataset tar shards for the image_text_shards node:\n"
    "  OUT_PREFIX.train-000000.tar ...  samples in name order: members KEY.png|jpg and KEY.txt\n"
    "  OUT_PREFIX.val-000000.tar ...    the held-out pairs\n"
    "  OUT_PREFIX.json                  counts per split, pairs skipped and why\n"
    "\n"
    "  --shard-size N     samples per shard (default 1000)\n"
    "  --val-fraction F   share of pairs held out for val, chosen by a seeded shuffle (default 0.05)\n"
    "  --seed K           seed of that shuffle (default 1)\n"
    "\n"
    "Images are stored as they are (not re-encoded), after a check that they decode. An image\n"
    "without a caption (or with an empty one) or one that does not decode is warned about and\n"
    "skipped. Exit codes: 0 done, 2 bad usage or input, 1 a write failed.\n";

std::string lower(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

std::string shard_name(const std::string& prefix, const char* split, int64_t k) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "-%06lld.tar", static_cast<long long>(k));
  return prefix + "." + split + buf;
}

// Removes PREFIX.SPLIT-NNNNNN.tar left from an earlier, larger run (k >= keep).
void remove_stale_shards(const std::string& prefix, const char* split, int64_t keep) {
  for (int64_t k = keep;; ++k) {
    std::error_code ec;
    if (!fs::remove(shard_name(prefix, split, k), ec)) break;
  }
}

}  // namespace

std::vector<ImageCaptionPair> find_image_caption_pairs(const std::string& dir, bool quiet, int64_t* no_caption,
                                                       int64_t* orphan_captions) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw std::invalid_argument(dir + ": no such folder");
  // Stems -> image and caption files.
  std::map<std::string, std::pair<std::string, std::string>> found;  // stem -> (image, caption)
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.empty() && name[0] == '.') {
      if (it->is_directory()) it.disable_recursion_pending();
      continue;
    }
    if (!it->is_regular_file()) continue;
    const std::string ext = lower(it->path().extension().string());
    // lexically: fs::relative resolves symlinks, which would pair a linked image by its target's name
    const std::string stem = it->path().lexically_relative(dir).replace_extension().generic_string();
    if (ext == ".png" || ext == ".jpg" || ext == ".jpeg") {
      auto& slot = found[stem].first;
      if (!slot.empty()) throw std::invalid_argument(stem + ": two images (" + slot + ", " + it->path().string() + ")");
      slot = it->path().string();
    } else if (ext == ".txt") {
      found[stem].second = it->path().string();
    }
  }
  if (ec) throw std::invalid_argument(dir + ": cannot list: " + ec.message());
  std::vector<ImageCaptionPair> pairs;
  for (const auto& [stem, files] : found) {
    if (files.first.empty()) {
      ++*orphan_captions;
      continue;
    }
    if (files.second.empty()) {
      ++*no_caption;
      if (!quiet) std::fprintf(stderr, "warning: %s: no caption (%s.txt): skipped\n", files.first.c_str(), stem.c_str());
      continue;
    }
    pairs.push_back({stem, files.first, files.second});
  }
  if (pairs.empty()) throw std::invalid_argument(dir + ": no image + caption pairs (X.png|jpg|jpeg with X.txt)");
  return pairs;
}

PrepImagesSummary prep_images(const PrepImagesOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  if (opt.dir.empty() || opt.out.empty()) throw std::invalid_argument("DIR and OUT_PREFIX are required");
  if (opt.shard_size < 1) throw std::invalid_argument("--shard-size must be >= 1");
  if (!(opt.val_fraction >= 0 && opt.val_fraction < 1))
    throw std::invalid_argument("--val-fraction must be in [0, 1), got " + std::to_string(opt.val_fraction));
  PrepImagesSummary s;
  const std::vector<ImageCaptionPair> pairs = find_image_caption_pairs(opt.dir, opt.quiet, &s.no_caption, &s.orphan_captions);

  // Val split: drawn from the pairs before decoding, so a bad image does not move the split.
  const auto n = static_cast<int64_t>(pairs.size());
  int64_t n_val = 0;
  if (opt.val_fraction > 0 && n >= 2) n_val = std::clamp<int64_t>(std::llround(opt.val_fraction * static_cast<double>(n)), 1, n - 1);
  std::vector<char> is_val(static_cast<size_t>(n), 0);
  const std::vector<int64_t> perm = seeded_permutation(n, mix_seed({opt.seed, kSeedTagValSplit}));
  for (int64_t i = 0; i < n_val; ++i) is_val[static_cast<size_t>(perm[static_cast<size_t>(i)])] = 1;

  const char* split_names[2] = {"train", "val"};
  std::unique_ptr<TarWriter> writers[2];
  int64_t in_shard[2] = {0, 0};
  for (int64_t i = 0; i < n; ++i) {
    const ImageCaptionPair& p = pairs[static_cast<size_t>(i)];
    const std::string caption = trim_space(read_file(p.caption));
    if (caption.empty()) {
      ++s.empty_caption;
      if (!opt.quiet) std::fprintf(stderr, "warning: %s: empty caption: skipped\n", p.caption.c_str());
      continue;
    }
    const std::string bytes = read_file(p.image);
    try {
      decode_image(bytes, p.image);
    } catch (const ImageError& e) {
      ++s.bad_image;
      if (!opt.quiet) std::fprintf(stderr, "warning: %s: skipped\n", e.what());
      continue;
    }
    const int k = is_val[static_cast<size_t>(i)] ? 1 : 0;
    if (!writers[k] || in_shard[k] == opt.shard_size) {
      if (writers[k]) writers[k]->finish();
      const std::string path = shard_name(opt.out, split_names[k], s.shards[k]++);
      writers[k] = std::make_unique<TarWriter>(path);
      s.shard_paths.push_back(path);
      in_shard[k] = 0;
    }
    // The key: the stem with dots in its file name replaced, so that it ends at the first dot.
    fs::path stem(p.stem);
    std::string file = stem.filename().string();
    std::replace(file.begin(), file.end(), '.', '_');
    const std::string key = (stem.has_parent_path() ? stem.parent_path().generic_string() + "/" : std::string()) + file;
    const std::string ext = sniff_image_format(bytes) == "png" ? "png" : "jpg";
    writers[k]->add(key + "." + ext, bytes);
    writers[k]->add(key + ".txt", caption);
    ++in_shard[k], ++s.samples[k];
  }
  for (int k = 0; k < 2; ++k) {
    if (writers[k]) writers[k]->finish();
    remove_stale_shards(opt.out, split_names[k], s.shards[k]);
  }
  if (s.samples[0] + s.samples[1] == 0) throw std::invalid_argument(opt.dir + ": no usable pairs (every one was skipped)");

  nlohmann::json j;
  j["samples"] = s.samples[0] + s.samples[1];
  for (int k = 0; k < 2; ++k) j["splits"][split_names[k]] = {{"samples", s.samples[k]}, {"shards", s.shards[k]}};
  j["skipped"] = {{"no_caption", s.no_caption}, {"bad_image", s.bad_image}, {"empty_caption", s.empty_caption}};
  j["captions_without_image"] = s.orphan_captions;
  j["shard_size"] = opt.shard_size;
  j["val_fraction"] = opt.val_fraction;
  j["seed"] = opt.seed;
  j["source"] = opt.dir;
  write_file_atomic(opt.out + ".json", j.dump(2) + "\n");
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return s;
}

int prep_images_command(const std::vector<std::string>& args) {
  PrepImagesOptions opt;
  return run_cli_command("prep images", kImagesUsage, args, [&](const CliArgs& cl) {
    for (const auto& [a, v] : cl.options) {
      if (a == "--shard-size") {
        opt.shard_size = static_cast<int64_t>(cli_uint(a, v));
      } else if (a == "--val-fraction") {
        opt.val_fraction = cli_number(a, v);
      } else if (a == "--seed") {
        opt.seed = cli_uint(a, v);
      } else {
        throw std::invalid_argument("unknown option " + a);
      }
    }
    const std::vector<std::string>& positional = cl.positional;
    if (positional.size() != 2) throw std::invalid_argument("expected DIR and OUT_PREFIX, got " + std::to_string(positional.size()) + " arguments");
    opt.dir = positional[0], opt.out = positional[1];
    const PrepImagesSummary s = prep_images(opt);
    std::printf("prep images: %lld pairs (train %lld in %lld shards, val %lld in %lld shards); skipped: %lld without caption, "
                "%lld empty captions, %lld bad images; %.2f s\n",
                static_cast<long long>(s.samples[0] + s.samples[1]), static_cast<long long>(s.samples[0]),
                static_cast<long long>(s.shards[0]), static_cast<long long>(s.samples[1]), static_cast<long long>(s.shards[1]),
                static_cast<long long>(s.no_caption), static_cast<long long>(s.empty_caption), static_cast<long long>(s.bad_image),
                s.seconds);
    std::printf("  %s.train-*.tar, %s.val-*.tar, %s.json\n", opt.out.c_str(), opt.out.c_str(), opt.out.c_str());
    return 0;
  });
}

}  // namespace flowrun
