// A linear layer's product, and its CPU kernel: see linear.hpp.
#include "models/linear.hpp"

#include <ATen/autocast_mode.h>

#include "common/cpu_blas.hpp"

namespace flowrun {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// C[m, n] (row-major, contiguous) = op(A) · op(B) + beta · C, A and B contiguous as stored; through
// the library run.cpu_gemm picks for the shape (common/cpu_blas.hpp).
void product(bool ta, bool tb, const torch::Tensor& a, const torch::Tensor& b, float beta, torch::Tensor& c) {
  const int64_t m = c.size(0), n = c.size(1), k = ta ? a.size(0) : a.size(1);
  cpu_blas::gemm(ta, tb, m, n, k, a.data_ptr<float>(), a.size(1), b.data_ptr<float>(), b.size(1), beta,
                  c.data_ptr<float>(), n);
}

thread_local DeferredWeightGrads* g_deferred = nullptr;  // open for this thread's products

struct CpuLinear : torch::autograd::Function<CpuLinear> {
  // x [..., in] -> [..., out]; weight [out, in], or [in, out] with w_in_out.
  // bias: [out], or [0] for none (a custom function's inputs must be defined tensors).
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight,
                               const torch::Tensor& bias, bool w_in_out) {
    const torch::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous(), w = weight.contiguous();
    const int64_t out = w_in_out ? w.size(1) : w.size(0);
    const bool has_bias = bias.numel() > 0;
    torch::Tensor y = torch::empty({x2.size(0), out}, x.options());
    if (has_bias) y.copy_(bias.expand_as(y));  // a copy: contiguous() of one row would be the bias itself
    if (x2.size(0) > 0) product(false, !w_in_out, x2, w, has_bias ? 1.0f : 0.0f, y);
    ctx->save_for_backward({x2, w});
    ctx->saved_data["w_in_out"] = w_in_out;
    // A zero-bubble schedule's weight gradients, for later (the weight and bias themselves: the
    // leaves flush() adds into).
    if (g_deferred && weight.is_leaf() && (!has_bias || bias.is_leaf())) {
      ctx->saved_data["deferred"] = reinterpret_cast<int64_t>(g_deferred);
      ctx->saved_data["weight"] = weight;
      ctx->saved_data["bias"] = bias;
    }
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    auto sizes = x.sizes().vec();
    sizes.back() = out;
    return y.view(sizes);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &x2 = saved[0], &w = saved[1];
    const bool w_in_out = ctx->saved_data["w_in_out"].toBool();
    const torch::Tensor g = grad_out[0].reshape({-1, grad_out[0].size(-1)}).contiguous();
    torch::Tensor dx, dw, db;
    const bool rows = g.size(0) > 0;
    if (ctx->needs_input_grad(0)) {
      dx = torch::empty_like(x2);
      if (rows) product(false, w_in_out, g, w, 0.0f, dx);  // g · Wᵀ ([in, out]) or g · W ([out, in])
      dx = dx.view(ctx->saved_data["x_sizes"].toIntVector());
    }
    if (ctx->saved_data.count("deferred") && (ctx->needs_input_grad(1) || ctx->needs_input_grad(2))) {
      DeferredWeightGrads::Item item;
      item.x = x2;
      item.g = g;
      item.w_in_out = w_in_out;
      item.weight_grad = ctx->needs_input_grad(1);
      if (ctx->needs_input_grad(2)) item.bias = ctx->saved_data["bias"].toTensor();
      item.weight = ctx->saved_data["weight"].toTensor();
      reinterpret_cast<DeferredWeightGrads*>(ctx->saved_data["deferred"].toInt())->add(std::move(item));
      return {dx, dw, db, torch::Tensor()};
    }
    if (ctx->needs_input_grad(1)) {
      dw = rows ? torch::empty_like(w) : torch::zeros_like(w);
      if (rows) {
        if (w_in_out)
          product(true, false, x2, g, 0.0f, dw);  // xᵀ · g: [in, out]
        else
          product(true, false, g, x2, 0.0f, dw);  // gᵀ · x: [out, in]
      }
    }
    if (ctx->needs_input_grad(2)) db = g.sum(0);
    return {dx, dw, db, torch::Tensor()};
  }
};

}  // namespace

DeferredWeightGrads::Scope::Scope(DeferredWeightGrads& d) : previous_(g_deferred) { g_deferred = &d; }
DeferredWeightGrads::Scope::~Scope() { g_deferred = previous_; }

void DeferredWeightGrads::flush() {
  torch::NoGradGuard no_grad;
  auto add = [](torch::Tensor p, torch::Tensor grad) {  // p: a handle, mutable_grad() is non-const
    torch::Tensor& into = p.mutable_grad();
    if (into.defined()) into.add_(grad);
    else into = std::move(grad);
  };
  for (Item& it : items_) {
    if (it.weight_grad) {
      const torch::Tensor& w = it.weight;
      torch::Tensor dw = it.g.size(0) > 0 ? torch::empty(w.sizes(), w.options()) : torch::zeros(w.sizes(), w.options());
      if (it.g.size(0) > 0) {
        if (it.w_in_out) product(true, false, it.x, it.g, 0.0f, dw);  // xᵀ · g: [in, out]
        else product(true, false, it.g, it.x, 0.0f, dw);              // gᵀ · x: [out, in]
      }
      add(it.weight, std::move(dw));
    }
    if (it.bias.defined()) add(it.bias, it.g.sum(0));
  }
  items_.clear();
}

bool cpu_linear_applies(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  auto f32_cpu = [](const torch::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == torch::kFloat; };
  return x.dim() >= 1 && f32_cpu(x) && f32_cpu(weight) && weight.dim() == 2 && (!bias.defined() || f32_cpu(bias)) &&
         !at::autocast::is_autocast_enabled(at::kCPU) && cpu_blas::active();
}

torch::Tensor cpu_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                         bool w_in_out) {
  return CpuLinear::apply(x, weight, bias.defined() ? bias : torch::empty({0}, weight.options()), w_in_out);
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias, bool w_in_out) {
  if (cpu_linear_applies(x, weight, bias)) return cpu_linear(x, weight, bias, w_in_out);
  if (!w_in_out) return torch::nn::functional::linear(x, weight, bias);
  if (x.dim() == 2 && bias.defined()) return torch::addmm(bias, x, weight);  // HF Conv1D: one call, as transformers computes it
  return bias.defined() ? torch::matmul(x, weight) + bias : torch::matmul(x, weight);
}

}  // namespace flowrun
