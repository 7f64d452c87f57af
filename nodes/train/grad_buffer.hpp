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
// How the gradients get into the buffer (GradFill): `accumulate` zeroes it and points the
// .grad()s at its views before backward, and autograd adds each micro-batch's gradient into them
// in place (a zero fill, then a read-add-write per parameter and micro-batch); `copy` leaves the
// .grad()s empty, so autograd writes each parameter's first gradient into a tensor of its own
// (and adds later micro-batches to it), and the finished gradient is copied into its view the
// moment it is final, the .grad() then pointing at the view (one copy per parameter, as DDP
// does; the zero fill and the add passes are gone). Both give bit-identical buffers.
// During the backward of the last micro-batch an autograd hook
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

enum class GradFill { accumulate, copy };

struct GradBuffer {
  using Slot = FlatLayout::Slot;
  // One flat 1-D buffer per (dtype, device) group of parameters.
  std::vector<torch::Tensor> flats;
  std::vector<int> kinds;  // per flat: its parameters' kind (make's)
  // Per trainable parameter (module order, as in common/grads.hpp): where its gradient lives,
  // and the view itself (shaped like the parameter).
  std::vector<Slot> slots;
  std::vector<torch::Tensor> views;
  // Parameters in buffer order (reverse module order within each group): order[k] is the
  // parameter at the k-th position; position[i] is parameter i's place in that order.
  std::vector<int> order, position;

  // Lay out (and zero) a buffer for these parameters; `kinds` (one per parameter, or empty) keeps
  // kinds apart in their own flats (kExperts: averaged over the ranks holding the same experts).
  static constexpr int kExperts = 1;
  static std::shared_ptr<GradBuffer> make(const std::vector<torch::Tensor>& params, const std::vector<int>& kinds = {});
  // True when nobody but this buffer and the parameters' .grad() holds its views, so it can be
  // zeroed and reused for the next step (a consumer may still hold the last step's grads).
  bool reusable() const;
  void zero();
  // Point each parameter's .grad() at its view.
  void attach(const std::vector<torch::Tensor>& params) const;
  // GradFill::copy: note the parameters (for reusable()) without touching their .grad().
  void remember(const std::vector<torch::Tensor>& params) const;
  // GradFill::copy: parameter i's finished gradient (its .grad(), or zeros when it has none)
  // into its view, and its .grad() pointed at the view.
  void settle(size_t i, torch::Tensor param) const;

  // The parameters last attach()ed (weakly: the buffer does not keep a model alive), so that
  // reusable() can tell the parameters' own .grad() references from a consumer's.
  mutable std::vector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> attached_to;
};

struct GradShard;  // train/optimizer_shard.hpp

// What the `ready` stream carries.
struct GradReady {
  int param = 0;      // index of the trainable parameter (module order)
  bool used = true;   // false: it got no gradient this step (its view, if any, is zero)
  // Where the gradients live: with data parallelism the buffer (grad is its view); in a single
  // process forward_backward may need none (grad is the tensor autograd wrote; buffer null).
  std::shared_ptr<GradBuffer> buffer;
  torch::Tensor grad;  // the finished gradient (undefined when !used)
  // ZeRO stage 2 (a zero plan's stage gradients, with several processes): no buffer; grad is
  // the tensor autograd wrote, which forward_backward no longer holds, and the allreduce keeps
  // only this rank's slice of the averaged gradients, as `shard` says.
  std::shared_ptr<const GradShard> shard;
};

}  // namespace flowrun
