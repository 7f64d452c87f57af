// GradBuffer: a model's gradients as views into flat buffers, and the `ready` stream that tells
// an all-reduce which of them backward has finished.
//
// forward_backward keeps the trainable parameters' .grad() as views into one flat buffer per
// (dtype, device), laid out in REVERSE parameter order: backward produces gradients roughly from
// the last parameter to the first, so parameters that become ready together sit next to each
// other, and a run of consecutive parameters is one contiguous slice of a buffer. The allreduce
// node reduces such slices in place as buckets: no copy into a bucket and none back out (like
// DDP's gradient_as_bucket_view and Megatron-LM's contiguous grad buffer).
//
// Each step forward_backward zeroes a buffer and points the .grad()s at its views; autograd then
// accumulates into them in place. During the backward of the last micro-batch an autograd hook
// on each parameter's grad accumulator emits a GradReady on the `ready` stream the moment that
// parameter's gradient is final; after backward, parameters that got no gradient are emitted
// with used = false. So every trainable parameter is emitted exactly once per step, in the order
// backward finished them (item index = emission order, count = number of trainable parameters).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "common/flat_buffers.hpp"

namespace flowrun {

struct GradBuffer {
  using Slot = FlatLayout::Slot;
  // One flat 1-D buffer per (dtype, device) group of parameters.
  std::vector<torch::Tensor> flats;
  // Per trainable parameter (module order, as in common/grads.hpp): where its gradient lives,
  // and the view itself (shaped like the parameter).
  std::vector<Slot> slots;
  std::vector<torch::Tensor> views;
  // Parameters in buffer order (reverse module order within each group): order[k] is the
  // parameter at the k-th position; position[i] is parameter i's place in that order.
  std::vector<int> order, position;

  // Lay out (and zero) a buffer for these parameters.
  static std::shared_ptr<GradBuffer> make(const std::vector<torch::Tensor>& params);
  // True when nobody but this buffer and the parameters' .grad() holds its views, so it can be
  // zeroed and reused for the next step (a consumer may still hold the last step's grads).
  bool reusable() const;
  void zero();
  // Point each parameter's .grad() at its view.
  void attach(const std::vector<torch::Tensor>& params) const;

  // The parameters last attach()ed (weakly: the buffer does not keep a model alive), so that
  // reusable() can tell the parameters' own .grad() references from a consumer's.
  mutable std::vector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> attached_to;
};

// What the `ready` stream carries.
struct GradReady {
  int param = 0;      // index of the trainable parameter (module order)
  bool used = true;   // false: it got no gradient this step (its view stays zero)
  std::shared_ptr<GradBuffer> buffer;
};

}  // namespace flowrun
