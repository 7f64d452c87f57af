// DataCursor: the object behind a data node's `cursor` state port (port type `cursor`), held
// in a Value as std::shared_ptr<DataCursor>. It says how far the reader got, so a checkpoint
// can record it and a resumed run can check it reads on from the same place.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>

namespace flowrun {

struct DataCursor {
  int64_t batches = 0;  // batches drawn so far = the last step read (steps are 1-based)

  std::map<std::string, torch::Tensor> tensors() const { return {{"batches", torch::tensor(batches, torch::kInt64)}}; }
  void load(const std::map<std::string, torch::Tensor>& t) {
    auto it = t.find("batches");
    if (it != t.end()) batches = it->second.item<int64_t>();
  }
};

}  // namespace flowrun
