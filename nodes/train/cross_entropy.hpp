// Mean cross-entropy of logits [N, V] against class ids [N], for the lm objective.
//
// Same value and gradient as torch::nn::functional::cross_entropy (mean reduction), but
// cheaper when V is large (a GPT's vocabulary): the forward keeps only logsumexp per row, and
// the backward writes softmax - one_hot straight into the one [N, V] gradient it returns.
// torch's log_softmax + nll_loss instead materialises a log-softmax output, a zero-filled nll
// gradient and the log_softmax gradient, three [N, V] tensors. On the CPU the rows are
// processed in chunks of about 1M elements, so the max / exp / sum passes over a chunk hit
// the cache. Measured on the 2-core CI machine, N = 2048, V = 50257, one thread: 0.56 s
// against 1.06 s for forward + backward (bench/README.md).
#pragma once
#include <torch/torch.h>

namespace flowrun {

// logits: float [N, V] (fp32 or wider; cast bf16/fp16 logits before); targets: int64 [N],
// each in [0, V). Returns a 0-d tensor with autograd to `logits`. No double backward.
torch::Tensor cross_entropy_mean(const torch::Tensor& logits, const torch::Tensor& targets);

}  // namespace flowrun
