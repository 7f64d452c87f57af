// Dataset: the object behind a data node's `dataset` state port (port type `dataset`), held
// in a Value as std::shared_ptr<Dataset>. It lets other nodes — the evaluator, samplers —
// draw fixed batches from a split (e.g. the held-out validation shard) without knowing the
// file format. A data node creates it in setup() (access none: it never changes).
#pragma once
#include <cstdint>
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

}  // namespace flowrun
