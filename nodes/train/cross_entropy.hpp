// Mean cross-entropy of logits [N, V] against class ids [N], for the lm objective.
//
// Two kernels, one result (the value and gradient of torch::nn::functional::cross_entropy with
// mean reduction, the softmax in fp32 whatever the logits' dtype):
//
// - chunked (the CPU's): the forward keeps only logsumexp per row, and the backward writes
//   softmax - one_hot straight into the one [N, V] gradient it returns, the rows processed in
//   chunks of about 1M elements so the max / exp / sum passes over a chunk hit the cache.
//   torch's log_softmax + nll_loss instead materialise a log-softmax output, a zero-filled nll
//   gradient and the log_softmax gradient, three [N, V] tensors. Measured on the 2-core CI
//   machine, N = 2048, V = 50257, one thread: 0.56 s against 1.06 s for forward + backward
//   (bench/README.md). bf16/fp16 logits are cast to fp32 first.
// - library (a GPU's): torch's own log_softmax (fp32 out; bf16 logits cast first, as autocast
//   does for the eager loop's F.cross_entropy) + nll_loss, one fused kernel each way. On a GPU the chunked kernel's loops are
//   generic element-wise kernels (exp, adds, max, sum: ~5.9 ms per GPT-2 124M step on an H200
//   where these take 3.3 ms; issue 30).
//
// `automatic` picks chunked for CPU logits and library for any other device.
#pragma once
#include <torch/torch.h>

namespace flowrun {

enum class CrossEntropyKernel { automatic, chunked, library };

// logits: floating [N, V] (any float dtype); targets: int64 [N], each in [0, V). Returns a 0-d
// fp32 tensor with autograd to `logits`. No double backward.
torch::Tensor cross_entropy_mean(const torch::Tensor& logits, const torch::Tensor& targets,
                                 CrossEntropyKernel kernel = CrossEntropyKernel::automatic);

}  // namespace flowrun
