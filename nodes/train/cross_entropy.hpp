// Mean cross-entropy of logits [N, V] against class ids [N], for the lm objective; per-row
// losses with label smoothing, for the caption objective.
//
// Three kernels, one result (the value and gradient of torch::nn::functional::cross_entropy
// with mean reduction, the softmax in fp32 whatever the logits' dtype):
//
// - chunked (the CPU's): the forward keeps only logsumexp per row, and the backward writes
//   softmax - one_hot straight into the one [N, V] gradient it returns (or, the logits being
//   the loss's to overwrite, the forward writes it over them: `logits_spent` below), the rows processed in
//   chunks of about 1M elements so the max / exp / sum passes over a chunk hit the cache.
//   torch's log_softmax + nll_loss instead materialise a log-softmax output, a zero-filled nll
//   gradient and the log_softmax gradient, three [N, V] tensors. Measured on the 2-core CI
//   machine, N = 2048, V = 50257, one thread: 0.56 s against 1.06 s for forward + backward
//   (bench/README.md). bf16/fp16 logits are cast to fp32 first.
// - fused (a CUDA device's, in a FLOWRUN_CUDA build): the same two steps as two kernels of our
//   own (train/cross_entropy_kernels.cu), one block per row, reading bf16/fp16/fp32 logits as
//   they are: the forward is one read of the logits (an online max and sum), the backward one
//   read and one write of the gradient in the logits' dtype. On GPT-2 124M (batch 8 x 1024,
//   vocab 50304, bf16) the library's path below costs a bf16 -> fp32 copy of the logits, a
//   log-softmax forward and backward over fp32 [N, V] and a cast of the gradient back, about
//   6 ms of a 30 ms step on an H100 (issue 30's kernel table).
// - library: torch's own log_softmax (fp32 out; bf16 logits cast first, as autocast does for
//   the eager loop's F.cross_entropy) + nll_loss, one library kernel each way: any device.
//
// `automatic` picks chunked for CPU logits, fused for CUDA logits where built, else library.
#pragma once
#include <torch/torch.h>

namespace flowrun {

enum class CrossEntropyKernel { automatic, chunked, fused, library };

// Whether this build has the fused CUDA kernels (FLOWRUN_CUDA).
bool fused_cross_entropy_built();

// logits: floating [N, V] (any float dtype); targets: int64 [N], each in [0, V). Returns a 0-d
// fp32 tensor with autograd to `logits`. No double backward.
// `logits_spent`: the caller reads the logits no more (lm_loss: the model's output is the loss's
// alone), so the chunked kernel computes the gradient in the forward and writes it over them:
// one [N, V] tensor and two passes over it fewer (cross_entropy.cpp, CrossEntropyMeanInPlace). It
// does so anyway with its own fp32 copy of bf16/fp16 logits. An op before the loss that kept the
// logits for its own backward (none of the built-in models' heads does) then finds them changed
// and autograd refuses the backward; a second backward (retain_graph) is refused too.
torch::Tensor cross_entropy_mean(const torch::Tensor& logits, const torch::Tensor& targets,
                                 CrossEntropyKernel kernel = CrossEntropyKernel::automatic, bool logits_spent = false);

// Each row's cross-entropy with label smoothing e: (1 - e) (-log p[target]) + e (-mean_j log p[j]),
// an fp32 [N] with autograd to `logits` (for losses weighted per token: the caption loss).
// `automatic` is fused for CUDA logits where built, else library (torch's log_softmax in fp32,
// gather and mean: the chunked kernel computes means only).
torch::Tensor cross_entropy_rows(const torch::Tensor& logits, const torch::Tensor& targets, double smoothing = 0,
                                 CrossEntropyKernel kernel = CrossEntropyKernel::automatic);

}  // namespace flowrun
