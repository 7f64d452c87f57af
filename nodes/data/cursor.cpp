// DataCursor (data/cursor.hpp) and its registration with checkpoint/resume (common/state_io.hpp).
#include "data/cursor.hpp"

#include <spdlog/spdlog.h>

#include <cstdio>
#include <stdexcept>

#include "common/state_io.hpp"

namespace flowrun {

std::string DataFingerprint::str() const {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(hash));
  std::string out = std::to_string(items) + " items in " + std::to_string(files) + " file(s), index hash " + hex;
  if (content) {
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(content));
    out += std::string(", content hash ") + hex;
  }
  return out;
}

std::map<std::string, torch::Tensor> DataCursor::tensors() const {
  std::map<std::string, torch::Tensor> t{{"batches", torch::tensor(batches, torch::kInt64)}};
  if (data.items >= 0)
    t["data"] = data.content ? torch::tensor({data.items, data.files, data.hash, data.content}, torch::kInt64)
                             : torch::tensor({data.items, data.files, data.hash}, torch::kInt64);
  return t;
}

// Issue 47: token shards rebuilt from another corpus, an image shard added or replaced, and the
// old cursor read on in the new data. Checkpoints written before the fingerprint have no "data".
void DataCursor::load(const std::map<std::string, torch::Tensor>& t) {
  auto saved = t.find("data");
  if (saved != t.end() && data.items >= 0) {
    const torch::Tensor d = saved->second.to(torch::kInt64).reshape({-1});
    if (d.numel() != 3 && d.numel() != 4)
      throw std::runtime_error("data cursor: tensor 'data' has " + std::to_string(d.numel()) + " values, expected 3 or 4");
    const DataFingerprint was{d[0].item<int64_t>(), d[1].item<int64_t>(), d[2].item<int64_t>(), d.numel() == 4 ? d[3].item<int64_t>() : 0};
    if (!(was == data)) {
      const std::string what = "the cursor was saved over other data than this reader's: then " + was.str() + ", now " +
                               data.str() + " (shards rebuilt, grown, added or replaced" +
                               (was.items == data.items && was.hash == data.hash ? "; the same names, rows and sizes: a file was changed in place" : "") + ")";
      if (refuse_changed)
        throw std::runtime_error(what + "; resume with the data the run was written with, or set the data node's "
                                 "on_data_change: continue to read on over the new data from the saved step");
      spdlog::warn("{}; reading on over the new data from the saved step (on_data_change: continue)", what);
    }
  }
  auto it = t.find("batches");
  if (it != t.end()) batches = it->second.item<int64_t>();
}

}  // namespace flowrun

FLOWRUN_STATE_TYPE(flowrun::DataCursor)
