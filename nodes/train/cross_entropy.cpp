// Fused cross-entropy: see cross_entropy.hpp.
#include "train/cross_entropy.hpp"

#include <algorithm>

#include "common/tensor_map.hpp"

#ifdef FLOWRUN_CUDA
#include <c10/cuda/CUDAStream.h>

#include "train/cross_entropy_kernels.hpp"
#endif

namespace flowrun {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// Rows per chunk: about 1M elements (4 MB of fp32) on the CPU; one chunk elsewhere (on a GPU
// each chunk would cost kernel launches, and the bandwidth argument does not apply).
int64_t chunk_rows(const torch::Tensor& logits) {
  const int64_t N = logits.size(0), V = std::max<int64_t>(1, logits.size(1));
  if (!logits.is_cpu()) return std::max<int64_t>(1, N);
  return std::max<int64_t>(1, (int64_t{1} << 20) / V);
}

struct CrossEntropyMean : torch::autograd::Function<CrossEntropyMean> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& targets) {
    const int64_t N = logits.size(0), R = chunk_rows(logits);
    torch::Tensor lse = torch::empty({N}, logits.options());
    for (int64_t r = 0; r < N; r += R) {
      const int64_t n = std::min(R, N - r);
      torch::Tensor x = logits.narrow(0, r, n);
      torch::Tensor m = std::get<0>(x.max(1, /*keepdim=*/true));  // for a stable exp
      lse.narrow(0, r, n).copy_((x - m).exp_().sum(1).log_().add_(m.squeeze(1)));
    }
    torch::Tensor picked = logits.gather(1, targets.unsqueeze(1)).squeeze(1);
    ctx->save_for_backward({logits, targets, lse});
    return (lse - picked).mean();
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& logits = saved[0];
    const torch::Tensor& targets = saved[1];
    const torch::Tensor& lse = saved[2];
    const int64_t N = logits.size(0), R = chunk_rows(logits);
    // d(mean_i(lse_i - x_i,t_i)) / dx = (softmax(x) - one_hot(t)) / N
    torch::Tensor grad = torch::empty_like(logits, at::MemoryFormat::Contiguous);
    for (int64_t r = 0; r < N; r += R) {
      const int64_t n = std::min(R, N - r);
      torch::Tensor out = grad.narrow(0, r, n);
      at::sub_out(out, logits.narrow(0, r, n), lse.narrow(0, r, n).unsqueeze(1));
      out.exp_();
    }
    grad.scatter_add_(1, targets.unsqueeze(1), torch::full({N, 1}, -1.0, grad.options()));
    grad.mul_(grad_out[0] / static_cast<double>(N));
    return {grad, torch::Tensor()};
  }
};

// The chunked kernel when the logits are the loss's to overwrite (`logits_spent`, or an fp32 copy
// of lower-precision logits): the gradient is computed in the forward, chunk by chunk while the
// chunk is in cache, and written over the logits themselves: per chunk the rows' max, exp in
// place, their sums (each row's loss: log sum + max - logit[target]), the 1/(sum N) scale and the
// -1/N at the targets. The backward hands that tensor out (scaled in place by a non-unit upstream
// gradient). Against the kernel above: no second [N, V] tensor (with a 32k vocabulary and 2048
// rows, 262 MB that glibc maps fresh each step and the kernel fills page by page) and two passes
// fewer over it. Once only: a second backward (retain_graph) is refused, the gradient having been
// handed out.
struct CrossEntropyMeanInPlace : torch::autograd::Function<CrossEntropyMeanInPlace> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& targets) {
    const int64_t N = logits.size(0), R = chunk_rows(logits);
    torch::Tensor x = logits.detach();  // written in place: the caller gave the logits up
    torch::Tensor nll = torch::empty({N}, x.options());
    const torch::Tensor minus = torch::full({R, 1}, -1.0 / static_cast<double>(N), x.options());
    for (int64_t r = 0; r < N; r += R) {
      const int64_t n = std::min(R, N - r);
      torch::Tensor c = x.narrow(0, r, n), t = targets.narrow(0, r, n).unsqueeze(1);
      const torch::Tensor m = std::get<0>(c.max(1, /*keepdim=*/true));  // for a stable exp
      const torch::Tensor picked = c.gather(1, t);
      const torch::Tensor sum = c.sub_(m).exp_().sum(1, /*keepdim=*/true);  // torch's sum: pairwise, accurate over 100k+ terms
      nll.narrow(0, r, n).copy_((sum.log() + m - picked).squeeze(1));    // lse - logit[target]
      c.mul_(sum.reciprocal().mul_(1.0 / static_cast<double>(N)));      // softmax / N
      c.scatter_add_(1, t, minus.narrow(0, 0, n));                       // - one_hot / N
    }
    ctx->saved_data["grad"] = x;
    return nll.mean();
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_out) {
    auto it = ctx->saved_data.find("grad");
    if (it == ctx->saved_data.end())
      throw std::runtime_error("cross_entropy_mean: backward twice through the in-place kernel (retain_graph), whose "
                               "gradient was written over the logits and handed out once; pass logits_spent = false");
    torch::Tensor grad = it->second.toTensor();
    ctx->saved_data.erase(it);
    if (const double g = grad_out[0].item<double>(); g != 1.0) grad.mul_(g);
    return {grad, torch::Tensor()};
  }
};

#ifdef FLOWRUN_CUDA
// The GPU's fused kernels (cross_entropy_kernels.cu): logits read in their own dtype, one fp32
// logsumexp per row kept for backward, the gradient written once in the logits' dtype.
cuda_kernels::Float kernel_dtype(const torch::Tensor& logits) {
  switch (logits.scalar_type()) {
    case torch::kFloat: return cuda_kernels::Float::f32;
    case torch::kBFloat16: return cuda_kernels::Float::bf16;
    case torch::kHalf: return cuda_kernels::Float::f16;
    default:
      throw std::runtime_error("cross_entropy_mean: the fused GPU kernel takes fp32, bf16 or fp16 logits, got " +
                               std::string(c10::toString(logits.scalar_type())));
  }
}

void check_launch(const char* error, const char* what) {
  if (error) throw std::runtime_error(std::string("cross_entropy_mean: ") + what + " kernel: " + error);
}

// The per-row losses (`mean` false: [N], with label smoothing) or their mean (a 0-d tensor).
struct CrossEntropyCuda : torch::autograd::Function<CrossEntropyCuda> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits_in, const torch::Tensor& targets_in,
                               double smoothing, bool mean) {
    torch::Tensor logits = logits_in.contiguous(), targets = targets_in.contiguous();
    const int64_t N = logits.size(0), V = logits.size(1);
    const auto f32 = logits.options().dtype(torch::kFloat);
    torch::Tensor lse = torch::empty({N}, f32), rows = torch::empty({N}, f32);
    check_launch(cuda_kernels::cross_entropy_forward(
                     kernel_dtype(logits), logits.data_ptr(), targets.data_ptr<int64_t>(), N, V,
                     static_cast<float>(smoothing), lse.data_ptr<float>(), rows.data_ptr<float>(),
                     c10::cuda::getCurrentCUDAStream(logits.device().index()).stream()),
                 "forward");
    ctx->save_for_backward({logits, targets, lse});
    ctx->saved_data["smoothing"] = smoothing;
    ctx->saved_data["mean"] = mean;
    return mean ? rows.mean() : rows;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& logits = saved[0];
    const torch::Tensor& targets = saved[1];
    const torch::Tensor& lse = saved[2];
    const bool mean = ctx->saved_data["mean"].toBool();
    torch::Tensor go = grad_out[0].to(logits.device(), torch::kFloat).contiguous();
    torch::Tensor grad = torch::empty_like(logits, at::MemoryFormat::Contiguous);
    check_launch(cuda_kernels::cross_entropy_backward(
                     kernel_dtype(logits), logits.data_ptr(), targets.data_ptr<int64_t>(), lse.data_ptr<float>(),
                     go.data_ptr<float>(), /*per_row=*/!mean, logits.size(0), logits.size(1),
                     static_cast<float>(ctx->saved_data["smoothing"].toDouble()), grad.data_ptr(),
                     c10::cuda::getCurrentCUDAStream(logits.device().index()).stream()),
                 "backward");
    return {grad, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};
#endif

// The checks both entry points make, and the kernel `automatic` stands for (`cpu`: the kernel
// for CPU logits).
CrossEntropyKernel check_and_pick(const char* who, const torch::Tensor& logits, const torch::Tensor& targets,
                                  CrossEntropyKernel kernel, CrossEntropyKernel cpu) {
  const std::string w = who;
  if (logits.dim() != 2 || targets.dim() != 1 || targets.size(0) != logits.size(0))
    throw std::runtime_error(w + ": logits must be [N, V] and targets [N], got " + shape_str(logits) + " and " +
                             shape_str(targets));
  if (!logits.is_floating_point()) throw std::runtime_error(w + ": logits must be floating point");
  if (targets.scalar_type() != torch::kLong) throw std::runtime_error(w + ": targets must be int64");
  if (logits.size(0) == 0) throw std::runtime_error(w + ": no rows");
  if (kernel == CrossEntropyKernel::automatic)
    kernel = logits.is_cpu() ? cpu
             : logits.is_cuda() && fused_cross_entropy_built() ? CrossEntropyKernel::fused
                                                                : CrossEntropyKernel::library;
  if (kernel == CrossEntropyKernel::fused) {
    if (!logits.is_cuda() || !targets.is_cuda())
      throw std::runtime_error(w + ": the fused kernel runs on a CUDA device; logits are on " + logits.device().str() +
                               ", targets on " + targets.device().str());
    if (!fused_cross_entropy_built())
      throw std::runtime_error(w + ": the fused kernel needs a CUDA build (FLOWRUN_CUDA=ON)");
  }
  return kernel;
}

}  // namespace

torch::Tensor cross_entropy_mean(const torch::Tensor& logits, const torch::Tensor& targets, CrossEntropyKernel kernel,
                                 bool logits_spent) {
  kernel = check_and_pick("cross_entropy_mean", logits, targets, kernel, CrossEntropyKernel::chunked);
#ifdef FLOWRUN_CUDA
  if (kernel == CrossEntropyKernel::fused) return CrossEntropyCuda::apply(logits, targets, 0.0, true);
#endif
  if (kernel == CrossEntropyKernel::library)  // fp32 log-probabilities, as autocast's cross_entropy
    return at::nll_loss(at::log_softmax(logits, 1, torch::kFloat), targets);
  const bool copied = logits.element_size() < 4;  // bf16/fp16: an fp32 copy, ours to overwrite
  const torch::Tensor x = copied ? logits.to(torch::kFloat) : logits;
  const bool wants_grad = torch::GradMode::is_enabled() && logits.requires_grad();
  if (wants_grad && (logits_spent || copied) && x.is_contiguous() && x.scalar_type() == torch::kFloat)
    return CrossEntropyMeanInPlace::apply(x, targets);
  return CrossEntropyMean::apply(x, targets);
}

torch::Tensor cross_entropy_rows(const torch::Tensor& logits, const torch::Tensor& targets, double smoothing,
                                 CrossEntropyKernel kernel) {
  if (!(smoothing >= 0 && smoothing <= 1))
    throw std::runtime_error("cross_entropy_rows: label smoothing must be in [0, 1], got " + std::to_string(smoothing));
  kernel = check_and_pick("cross_entropy_rows", logits, targets, kernel, CrossEntropyKernel::library);
  if (kernel == CrossEntropyKernel::chunked)
    throw std::runtime_error("cross_entropy_rows: the chunked kernel computes means only; use library or fused");
#ifdef FLOWRUN_CUDA
  if (kernel == CrossEntropyKernel::fused) return CrossEntropyCuda::apply(logits, targets, smoothing, false);
#endif
  // fp16/bf16 logits read as they are, fp32 log-probabilities (double ones for double logits)
  const torch::Tensor logp = torch::log_softmax(logits, -1, logits.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat);
  torch::Tensor rows = -logp.gather(1, targets.unsqueeze(1)).squeeze(1);
  if (smoothing > 0) rows = (1.0 - smoothing) * rows - smoothing * logp.mean(-1);
  return rows;
}

bool fused_cross_entropy_built() {
#ifdef FLOWRUN_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace flowrun
