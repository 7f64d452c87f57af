// The one attention of every model family (attention.hpp).
#include "models/attention.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

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

}  // namespace flowrun
