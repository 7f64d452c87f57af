// DataCursor: the object behind a data node's `cursor` state port (port type `cursor`), held
// in a Value as std::shared_ptr<DataCursor>. It says how far the reader got, so a checkpoint
// can record it and a resumed run can check it reads on from the same place, and what it reads
// (the data's fingerprint), so that a resume over data changed since is noticed.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>

namespace flowrun {

// What a cursor indexes: the count of items (windows, samples) and of files, and a hash of the
// index (each item's size and place), set by the data node at setup. Data rebuilt from another
// corpus, grown, or with a shard added or replaced has another fingerprint.
// `content` (0: none) is a hash of the bytes themselves where the index hash sees only names and
// sizes (Arrow files: a file changed in place at equal size); checkpoints written before it
// have none and are compared without it.
struct DataFingerprint {
  int64_t items = -1;  // -1: none (a node that does not say; a checkpoint written before it was kept)
  int64_t files = 0;
  int64_t hash = 0;
  int64_t content = 0;
  bool operator==(const DataFingerprint& o) const {
    return items == o.items && files == o.files && hash == o.hash && (content == 0 || o.content == 0 || content == o.content);
  }
  std::string str() const;  // "1200 items in 3 file(s), index hash 0123abcd..., content hash ..."
};

struct DataCursor {
  int64_t batches = 0;   // batches drawn so far = the last step read (steps are 1-based)
  DataFingerprint data;  // what it reads (set at setup)
  bool refuse_changed = true;  // load() over other data: refused, else a warning and it reads on

  std::map<std::string, torch::Tensor> tensors() const;
  void load(const std::map<std::string, torch::Tensor>& t);
  // A data node's check before it draws step `step`'s batch: a cursor restored from a checkpoint
  // of step k is followed by step k + 1, else an error naming both.
  void expect_step(int64_t step) const {
    if (batches != step - 1)
      throw std::runtime_error("data cursor says " + std::to_string(batches) + " batches were drawn, but this is step " +
                               std::to_string(step) + " (expected " + std::to_string(step - 1) +
                               "): the cursor was restored from another step than the run resumes at");
  }
};

}  // namespace flowrun
