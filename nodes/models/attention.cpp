// The one attention of every model family (attention.hpp).
#include "models/attention.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/tensor_map.hpp"

namespace flowrun {

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const AttentionOptions& o) {
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2);
  const double scale = o.scale != 0.0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  auto merge_heads = [&](const torch::Tensor& y) { return y.transpose(1, 2).reshape({B, Lq, H * v.size(3)}); };
  if (fused_attention_available(q)) return merge_heads(fused_attention(q, k, v, o.bias, o.causal, scale));
  const torch::Tensor kt = k.transpose(-1, -2);
  const int64_t rows = std::max<int64_t>(1, (int64_t{1} << 25) / std::max<int64_t>(1, B * H * Lk));
  std::vector<torch::Tensor> parts;
  for (int64_t i = 0; i < Lq; i += rows) {
    const int64_t n = std::min(rows, Lq - i);
    // The scores in place: neither matmul's backward nor softmax's needs them before the softmax.
    torch::Tensor s = torch::matmul(n == Lq ? q : q.narrow(2, i, n), kt);
    if (scale != 1.0) s.mul_(scale);
    if (o.bias.defined()) {
      const torch::Tensor b = o.bias.dim() >= 2 && o.bias.size(-2) == Lq && n != Lq ? o.bias.narrow(-2, i, n) : o.bias;
      if (s.sizes().vec() == at::infer_size(s.sizes(), b.sizes())) s.add_(b.to(s.scalar_type()));
      else s = s + b.to(s.scalar_type());  // the bias is the larger: the sum takes its shape
    }
    if (o.causal) {
      const auto opts = torch::TensorOptions().dtype(torch::kLong).device(s.device());
      const torch::Tensor above = torch::arange(i, i + n, opts).unsqueeze(1) < torch::arange(Lk, opts).unsqueeze(0);
      s.masked_fill_(above, -std::numeric_limits<double>::infinity());
    }
    parts.push_back(torch::matmul(o.fp32_softmax ? torch::softmax(s, -1, torch::kFloat).to(v.scalar_type())
                                                 : torch::softmax(s, -1),
                                  v));
  }
  return merge_heads(parts.size() == 1 ? parts[0] : torch::cat(parts, 2));
}

torch::Tensor self_attention(const torch::Tensor& qkv, int64_t B, int64_t L, int64_t H, const AttentionOptions& o) {
  const int64_t C = qkv.size(-1) / 3;
  if (qkv.size(-1) != 3 * C || C % H != 0 || qkv.numel() != B * L * 3 * C)
    throw std::logic_error("self_attention: qkv " + shape_str(qkv) + " is not [" + std::to_string(B) + ", " +
                           std::to_string(L) + ", 3 * heads * head_dim] with " + std::to_string(H) + " heads");
  const torch::Tensor x = qkv.view({B, L, 3 * C});
  if (!fused_attention_available(x) && cpu_attention_kernel_applies(x, o))
    return cpu_self_attention(x, H, o.causal, o.scale != 0.0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(C / H)));
  // q, k and v as strided views of the projection ([B, L, H, D] seen as [B, H, L, D]), which
  // the fused GPU kernels read as they are.
  const std::vector<torch::Tensor> parts = x.split(C, 2);
  auto heads = [&](const torch::Tensor& t) { return t.view({B, L, H, C / H}).transpose(1, 2); };
  return attention(heads(parts[0]), heads(parts[1]), heads(parts[2]), o);
}

}  // namespace flowrun
