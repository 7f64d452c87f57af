// Dataset: the object behind a data node's `dataset` state port (port type `dataset`), held
// in a Value as std::shared_ptr<Dataset>. It lets other nodes — the evaluator, samplers —
// draw fixed batches from a split (e.g. the held-out validation shard) without knowing the
// file format. A data node creates it in setup() (access none: it never changes).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/tensor_map.hpp"

namespace flowrun {

class Dataset {
 public:
  virtual ~Dataset() = default;
  // Splits this dataset has ("train", "val").
  virtual std::vector<std::string> splits() const = 0;
  // Number of distinct batches of `batch` rows the split holds for this rank (one pass, in
  // a fixed order; `rank`/`world` shard it the same way as training data).
  virtual int64_t num_batches(const std::string& split, int64_t batch, int rank, int world) const = 0;
  // Batch `index` (0-based, < num_batches) of that pass: the same for the same arguments,
  // whatever was read before. Keys as the node's `batch` output (e.g. "tokens").
  virtual TensorMap batch(const std::string& split, int64_t index, int64_t batch, int rank, int world) const = 0;
  // The captions of the same rows (image-text data), for evaluators that condition on text.
  // Datasets without text return an empty list.
  virtual std::vector<std::string> captions(const std::string& split, int64_t index, int64_t batch, int rank,
                                            int world) const {
    (void)split, (void)index, (void)batch, (void)rank, (void)world;
    return {};
  }
};

// The fixed pass the datasets share: the rows of a split in their stored order; batch `index`
// of `batch` rows for rank r of `world` is rows index*world*batch + r*batch + [0, batch), so the
// ranks of one batch read disjoint slices and together the rows one process would read in a
// batch of world*batch. `who` names the dataset in errors.
inline int64_t fixed_pass_batches(int64_t rows, int64_t batch, int rank, int world, const std::string& who) {
  if (batch < 1 || world < 1 || rank < 0 || rank >= world) throw std::invalid_argument(who + ": bad batch/rank/world");
  return rows / (batch * world);
}
inline std::vector<int64_t> fixed_pass_rows(int64_t rows, const std::string& split, int64_t index, int64_t batch, int rank,
                                            int world, const std::string& who) {
  const int64_t n = fixed_pass_batches(rows, batch, rank, world, who);
  if (index < 0 || index >= n)
    throw std::out_of_range(who + ": split '" + split + "' has " + std::to_string(n) + " batches of " +
                            std::to_string(batch) + " for world " + std::to_string(world) + "; no batch " +
                            std::to_string(index));
  std::vector<int64_t> out(static_cast<size_t>(batch));
  const int64_t first = index * world * batch + static_cast<int64_t>(rank) * batch;
  for (int64_t j = 0; j < batch; ++j) out[static_cast<size_t>(j)] = first + j;
  return out;
}

}  // namespace flowrun
