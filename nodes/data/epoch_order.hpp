// The training order of a data node whose batch is a pure function of the step: `count` items
// (token windows, packed rows), each epoch a seeded shuffle of all of them (epoch e: seed mixed
// with e); a step takes the next world x batch items of its epoch, rank r the r-th batch-sized
// slice, so ranks read disjoint items and together cover the step's. An epoch has
// floor(count / (world x batch)) steps; the items left over differ from epoch to epoch.
// Thread-safe (steps come in order, so each epoch's permutation is built once).
#pragma once
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/seed.hpp"
#include "data/shuffle.hpp"

namespace flowrun {

class EpochOrder {
 public:
  // `items`: what the items are, for the error when a step needs more ("data/x.train.{bin,idx}:
  // 900 tokens make 6 windows of seq_len+1 = 17 tokens").
  EpochOrder(int64_t count, int64_t batch, uint64_t seed, std::string items)
      : count_(count), batch_(batch), seed_(seed), items_(std::move(items)) {
    if (batch < 1) throw std::invalid_argument("batch must be >= 1");
  }
  int64_t count() const { return count_; }
  int64_t batch_size() const { return batch_; }

  // Steps per epoch for this world size; throws if not even one step's items exist.
  int64_t steps_per_epoch(int world) const {
    const int64_t per_step = batch_ * world;
    if (count_ < per_step)
      throw std::runtime_error(items_ + ", but one step needs world x batch = " + std::to_string(world) + " x " +
                               std::to_string(batch_) + " = " + std::to_string(per_step) +
                               ": use a smaller seq_len or batch, or more data");
    return count_ / per_step;
  }

  // The items rank `rank` of `world` reads at `step` (1-based), in batch order; rank -1: the
  // whole step's (every rank's slice, in rank order).
  std::vector<int64_t> for_step(int64_t step, int rank, int world) const {
    if (step < 1) throw std::invalid_argument("steps are 1-based; got " + std::to_string(step));
    if (world < 1 || rank < -1 || rank >= world)
      throw std::invalid_argument("rank " + std::to_string(rank) + " is not in a world of " + std::to_string(world));
    const int64_t spe = steps_per_epoch(world);
    const int64_t epoch = (step - 1) / spe, k = (step - 1) % spe;
    const int64_t first = k * world * batch_ + (rank < 0 ? 0 : static_cast<int64_t>(rank) * batch_);
    const int64_t n = rank < 0 ? world * batch_ : batch_;
    std::lock_guard<std::mutex> lock(mu_);
    if (epoch != cached_epoch_) {
      perm_ = seeded_permutation(count_, mix_seed({seed_, kSeedTagEpoch, static_cast<uint64_t>(epoch)}));
      cached_epoch_ = epoch;
    }
    return std::vector<int64_t>(perm_.begin() + first, perm_.begin() + first + n);
  }

 private:
  int64_t count_, batch_;
  uint64_t seed_;
  std::string items_;
  mutable std::mutex mu_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> perm_;
};

}  // namespace flowrun
