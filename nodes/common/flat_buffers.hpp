// Flat buffers: a list of tensors as views into one contiguous 1-D buffer per (dtype, device).
//
// A model's trainable parameters (FlatParams, below), their gradients (train/grad_buffer.hpp)
// and the optimizer's moments each live in such buffers, so that an update, an average or an
// all-reduce runs over a few long buffers instead of one tensor at a time (Megatron-LM's
// contiguous parameter and gradient buffers, DDP's gradient_as_bucket_view).
//
// FlatLayout says where each tensor lives; it depends only on the tensors' dtypes, devices and
// sizes, so two lists of like tensors (parameters and their moments, a model and its EMA copy)
// get the same layout and their buffers can be combined element by element.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace flowrun {

struct FlatLayout {
  struct Slot {
    int group = 0;       // which buffer
    int64_t offset = 0;  // first element in it
    int64_t numel = 0;
  };
  struct Group {
    torch::Dtype dtype;
    c10::Device device;
    int64_t numel;
    int kind = 0;  // the tensors' kind (of()'s `kinds`: a gradient buffer's experts, reduced over other ranks)
  };
  std::vector<Slot> slots;    // per tensor, in the order given
  std::vector<Group> groups;  // per buffer, numbered in the order their first tensor appears
  // Tensors in buffer order: order[k] is the tensor at the k-th position (groups one after the
  // other); position[i] is tensor i's place in that order.
  std::vector<int> order, position;

  // Within a group the tensors follow the given order, or the reverse (`reverse`: gradient
  // buffers, which backward fills from the last layer to the first).
  // `kinds` (one per tensor, or empty: all 0) separates groups further: tensors of two kinds never
  // share a buffer (a gradient buffer's experts under expert parallel, averaged over other ranks).
  static FlatLayout of(const std::vector<torch::Tensor>& tensors, bool reverse = false, const std::vector<int>& kinds = {});
  bool operator==(const FlatLayout& o) const;
  // One zeroed buffer per group.
  std::vector<torch::Tensor> zeros() const;
  // Tensor i's view into `buffers` (laid out by this layout), shaped `sizes`.
  torch::Tensor view(const std::vector<torch::Tensor>& buffers, size_t i, at::IntArrayRef sizes) const;
};

// Tensors whose data is moved into flat buffers: each keeps its identity (the same TensorImpl,
// so autograd, .grad() and every holder of it see the change) and its values; its data becomes
// a view (set_data) into the buffer of its group. ModelState holds one for its trainable
// parameters; the optimizer, their writer, makes them flat on its first update, and readers
// that combine whole models (ema) then work on the buffers.
//
// A copy starts empty: the copy of a model owns other tensors.
class FlatParams {
 public:
  FlatParams() = default;
  FlatParams(const FlatParams&) {}
  FlatParams& operator=(const FlatParams&) {
    layout_ = FlatLayout();
    buffers_.clear();
    return *this;
  }

  // Moves the tensors' data into buffers, unless they all live there already (then nothing
  // happens). Only a writer of the tensors may call it (it replaces their storage).
  void ensure(const std::vector<torch::Tensor>& tensors);
  // The buffers, if every tensor (same list as ensure()) still lives in them; nullptr when they
  // were never flattened or someone replaced a tensor's data since.
  const std::vector<torch::Tensor>* buffers_of(const std::vector<torch::Tensor>& tensors) const;
  const FlatLayout& layout() const { return layout_; }

 private:
  FlatLayout layout_;
  std::vector<torch::Tensor> buffers_;
};

}  // namespace flowrun
