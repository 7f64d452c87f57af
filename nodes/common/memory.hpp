// Model sizes checked before anything is allocated: a config that cannot fit is an error with
// the figures, not a bad_alloc after a minute (or the machine's memory taken). Torch-free.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace flowrun {

// Bytes this process may still allocate on the host: MemAvailable (/proc/meminfo), lowered
// to the cgroup's memory limit minus its usage where there is one (containers, Slurm jobs).
// 0 when unknown.
uint64_t available_host_memory();

// Bytes per parameter in fp32: the weight, its gradient, AdamW's two moments. The checks below
// and forward_backward's estimate count with these.
constexpr double kWeightBytes = 4, kGradBytes = 4, kAdamwStateBytes = 8;

// A model of `params` parameters, about to be built on the host. Refuses (std::runtime_error
// naming `who`, the config in `config` and the figures) when its fp32 weights and gradients
// alone exceed available_host_memory(); warns when training with AdamW (weights, gradients,
// two moments: 16 bytes a parameter) would. `frozen`: weights only (4 bytes a parameter).
// The whole step, activations included, is estimated and checked by forward_backward before
// its first step (TrainingMemory), once the batch's shape is known. `layers`: its count of
// repeated blocks, refused above kMaxLayers before any is built (each block is modules, with a
// cost of their own that the parameter count does not see: a million narrow layers passed the
// parameter check and ended in std::bad_alloc after half a minute).
constexpr int64_t kMaxLayers = 10000;  // the deepest published models have a few hundred
void check_model_fits(const std::string& who, const std::string& config, double params, bool frozen = false,
                      int64_t layers = 0);

// A batch a data node is about to make each step, `bytes` large (`what` says of what): refused
// (std::runtime_error naming `who`) when it alone exceeds available_host_memory(), before the
// first step tries (data.size or batch absurd ended in torch's allocator text).
void check_batch_fits(const std::string& who, const std::string& what, double bytes);

// "12.3 MB" (powers of 1000).
std::string bytes_text(double bytes);

// What a node keeps per rank for a model besides its weights (an optimizer's state, an EMA's
// copy), noted on the model's state at setup (ModelState::kept). `fix`: a setting that would
// shrink it ("zero.stage=states") and `fixed` its bytes then; empty: none.
struct MemoryItem {
  std::string what;  // "optimizer state (adamw)"
  std::string node;  // the node that keeps it
  double bytes = 0;
  bool allocated = false;  // already in memory before the first step (an EMA's copy is made at setup)
  std::string fix;
  double fixed = 0;
  bool fix_shards_gradients = false;  // the fix shards the gradients too (ZeRO-2): forward_backward adds that saving
  int shards = 1;  // `bytes` is this rank's 1/shards (sharded by ZeRO over that many data-parallel ranks)
};

// A training step's memory per rank, as forward_backward estimates it before its first step:
// the model's weights and gradients, what other nodes keep for it, and the activations backward
// keeps of one micro-batch (models/activation_checkpoint.hpp's estimate; < 0: the model gives
// none). Compared with what the device has left (`available`; 0: unknown).
struct TrainingMemory {
  double weights = 0, gradients = 0;
  std::string gradients_note;  // where they are, when more than one copy ("autograd's + 2 all-reduce buffers")
  std::vector<MemoryItem> kept;
  double activations = -1;
  std::string activations_note;  // "16 rows, fp32, checkpoint: none"
  double total() const;
  // What is not allocated yet: gradients, kept items not yet allocated, activations.
  double to_allocate() const;
  // "weights 1.2 MB, gradients 1.2 MB, optimizer state (adamw; opt) 2.4 MB, ..., = 6.1 MB"
  std::string text() const;
};

}  // namespace flowrun
