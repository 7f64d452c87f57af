// The pieces behind the token_shards node, usable on their own (tests, evaluators, benches).
//
// Windows: a split's token stream (every sequence of PREFIX.SPLIT.bin in index order,
// concatenated; documents are already separated by gpt2's end-of-text token) is cut into
// windows of seq_len + 1 tokens that start every seq_len tokens: window w holds tokens
// [w*seq_len, w*seq_len + seq_len + 1). Inputs are tokens[:-1], targets tokens[1:], so every
// token is a target exactly once per epoch and windows never overlap in targets; windows
// cross document boundaries (as Megatron's GPT dataset and nanoGPT do).
//
// Order: epoch e is a seeded shuffle of all windows (seed mix(seed, e)). A step takes the
// next world*batch windows of the epoch; rank r takes the r-th batch-sized slice, so ranks
// read disjoint windows and together cover the step's. An epoch has
// floor(windows / (world*batch)) steps; the windows left over differ from epoch to epoch.
// The batch of step s is a pure function of (data, seed, s, rank, world).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/tensor_map.hpp"
#include "data/dataset.hpp"
#include "data/epoch_order.hpp"
#include "formats/indexed_dataset.hpp"

namespace flowrun {

// Fixed windows over one split's token stream.
class TokenWindows {
 public:
  TokenWindows(std::shared_ptr<const IndexedDataset> data, int64_t seq_len);
  int64_t count() const { return count_; }
  int64_t seq_len() const { return seq_len_; }
  const IndexedDataset& data() const { return *data_; }
  // Copies window w (seq_len + 1 tokens) into out.
  void read(int64_t w, int64_t* out) const { data_->read_tokens(w * seq_len_, seq_len_ + 1, out); }
  // {"tokens": int64 [ids.size(), seq_len + 1]}: the windows ids, one per row.
  TensorMap batch(const std::vector<int64_t>& ids) const;

 private:
  std::shared_ptr<const IndexedDataset> data_;
  int64_t seq_len_, count_;
};

// The training order (data/epoch_order.hpp) over the windows. Thread-safe.
class TokenShardSampler {
 public:
  TokenShardSampler(TokenWindows windows, int64_t batch, uint64_t seed);
  const TokenWindows& windows() const { return windows_; }
  int64_t batch_size() const { return order_.batch_size(); }
  // Steps per epoch for this world size; throws if not even one step's windows exist.
  int64_t steps_per_epoch(int world) const { return order_.steps_per_epoch(world); }
  // The windows rank `rank` of `world` reads at `step` (1-based), in batch order.
  std::vector<int64_t> windows_for_step(int64_t step, int rank, int world) const { return order_.for_step(step, rank, world); }
  // {"tokens": int64 [batch, seq_len + 1]} for (step, rank, world).
  TensorMap batch(int64_t step, int rank, int world) const { return windows_.batch(windows_for_step(step, rank, world)); }

 private:
  TokenWindows windows_;
  EpochOrder order_;
};

// The `dataset` state of token_shards: fixed passes over each split present (train, val), in
// file order (no shuffle), sharded by rank like training: batch i of rank r holds windows
// i*world*batch + r*batch + [0, batch).
class TokenShardsDataset : public Dataset {
 public:
  // `splits`: name -> windows (only the splits whose files exist).
  explicit TokenShardsDataset(std::vector<std::pair<std::string, TokenWindows>> splits) : splits_(std::move(splits)) {}
  std::vector<std::string> splits() const override;
  int64_t num_batches(const std::string& split, int64_t batch, int rank, int world) const override;
  TensorMap batch(const std::string& split, int64_t index, int64_t batch, int rank, int world) const override;

 private:
  const TokenWindows& find(const std::string& split) const;
  std::vector<std::pair<std::string, TokenWindows>> splits_;
};

}  // namespace flowrun
