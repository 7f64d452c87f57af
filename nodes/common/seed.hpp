// Seeds: derive independent, reproducible random streams from (seed, tag, step, ...) without
// touching torch's global generator (nodes run on several threads at once).
#pragma once
#include <ATen/CPUGeneratorImpl.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "hash.hpp"

namespace flowrun {

// SplitMix64 finalizer: a bijective mix, so distinct inputs give unrelated outputs.
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// One seed from several parts, order-sensitive: mix_seed({seed, step}) != mix_seed({step, seed}).
inline uint64_t mix_seed(std::initializer_list<uint64_t> parts) {
  uint64_t h = 0x243F6A8885A308D3ull;
  for (uint64_t p : parts) h = splitmix64(h ^ splitmix64(p));
  return h;
}

// A string (a node's name) as a seed part: FNV-1a, stable across runs and platforms, so two
// nodes with one `seed` still draw different streams.
inline uint64_t name_seed(const std::string& s) { return fnv1a(s); }

// A CPU generator of its own (thread-safe to use from one node; independent of torch's global one).
inline at::Generator make_cpu_generator(uint64_t seed) { return at::detail::createCPUGenerator(seed); }

// Tags that keep the streams of different uses of one seed apart: mix_seed({seed, tag, ...}).
// Every use's tag is here, once (a new use adds its own; kSeedTags lists them for the test that
// they differ). The values are the names' ASCII bytes, so a checkpoint's draws never change.
enum : uint64_t {
  kSeedTagTeacher = 0x7465616368ull,     // "teach": synthetic_regression's teacher network
  kSeedTagBatch = 0x6261746368ull,       // "batch": synthetic data's batches
  kSeedTagInit = 0x696e6974ull,          // "init": a model's initialisation
  kSeedTagEpoch = 0x65706f6368ull,       // "epoch": the data readers' shuffle of an epoch
  kSeedTagDropout = 0x64726f706f7574ull, // "dropout": TrainingScope's dropout stream (models/dropout.hpp)
  kSeedTagRows = 0x726f7773ull,          // "rows": TrainingScope::row_seed, per global row
  kSeedTagDiffusion = 0x646966667573ull, // "diffus": diffusion's t and noise outside training
  kSeedTagCaption = 0x636170706100ull,   // "cappa": caption_loss's per-row draws
  kSeedTagLora = 0x6c6f7261ull,          // "lora": the adapters' A init
  kSeedTagBuckets = 0x6275636b6574ull,   // "bucket": image_text_shards' bucket order
  kSeedTagFlip = 0x666c6970ull,          // "flip": image_text_shards' flips
  kSeedTagLatent = 0x7661656c6174ull,    // "vaelat": vae_encode's latent sample
  kSeedTagShapes = 0x7368617065ull,      // "shape": the synthetic shapes' drawing (data/shapes.cpp)
  kSeedTagValSplit = 0x76616c73706c6974ull,  // "valsplit": prep's choice of the held-out documents and images
};
inline constexpr uint64_t kSeedTags[] = {kSeedTagTeacher, kSeedTagBatch,     kSeedTagInit,    kSeedTagEpoch,
                                         kSeedTagDropout, kSeedTagRows,      kSeedTagDiffusion, kSeedTagCaption,
                                         kSeedTagLora,    kSeedTagBuckets,   kSeedTagFlip,    kSeedTagLatent,
                                         kSeedTagShapes,  kSeedTagValSplit};

}  // namespace flowrun
