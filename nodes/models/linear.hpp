// The product of a linear layer: y = x · Wᵀ + b (weight [out, in], as torch::nn::Linear) or
// y = x · W + b (w_in_out: weight [in, out], Hugging Face's Conv1D); lora::Linear's base product
// and GPT's tied head. Where cpu_linear_applies() (float32 on the CPU, OpenBLAS installed and
// not refused: common/cpu_blas.hpp, run.cpu_gemm), one autograd function whose three products
// each run through the library chosen for their shape (OpenBLAS or libtorch's GEMM, by a
// measurement kept per machine); elsewhere libtorch's linear (addmm), or for Conv1D's layout
// matmul as transformers computes it.
//
// Forward copies the bias into y and multiplies with β = 1 (as torch's addmm does), for a
// [..., in] input of any rank: one product over the rows, never a separate bias pass (libtorch's
// x · W + b for a 3-d x in Conv1D's layout is a product and then an add). Backward computes only
// the gradients autograd asks for: dx = g · W (or g · Wᵀ), dW = gᵀ · x (or xᵀ · g), db = Σ rows g.
// Test: tests/nodes/linear_test.cpp (the kernel against torch's linear, values and gradients).
#pragma once
#include <torch/torch.h>

#include <vector>

namespace flowrun {

// Zero-bubble pipeline schedules (train/pipeline.cpp) split a backward into the input's gradient,
// which the previous stage waits for, and the weights' gradients, run later to fill the bubbles.
// While a DeferredWeightGrads is open on the thread that runs forward, the CPU kernel's products
// (cpu_linear_applies, a leaf weight) note it: their backward computes dx only and keeps (x, g)
// here, and flush() adds dW = gᵀ · x (or xᵀ · g) and db = Σ rows g to the weight's and bias's
// .grad(). Other products' weight gradients are computed in backward as always.
class DeferredWeightGrads {
 public:
  DeferredWeightGrads() = default;
  DeferredWeightGrads(const DeferredWeightGrads&) = delete;
  DeferredWeightGrads& operator=(const DeferredWeightGrads&) = delete;
  // Opens this one on the calling thread for the products made in the scope's lifetime.
  class Scope {
   public:
    explicit Scope(DeferredWeightGrads& d);
    ~Scope();

   private:
    DeferredWeightGrads* previous_;
  };
  struct Item {
    torch::Tensor x, g, weight, bias;  // bias undefined: none, or it needs no gradient
    bool w_in_out = false, weight_grad = false;
  };
  void add(Item item) { items_.push_back(std::move(item)); }
  // The deferred gradients into .grad(), in the order backward made them; then empty.
  void flush();
  bool empty() const { return items_.empty(); }

 private:
  std::vector<Item> items_;
};

// bias may be undefined (no bias).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias = {},
                     bool w_in_out = false);

// The CPU kernel alone, for the tests:

// x, weight (and bias, when defined) float32 on the CPU, outside CPU autocast, and OpenBLAS active.
bool cpu_linear_applies(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias);

// bias may be undefined (no bias).
torch::Tensor cpu_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                         bool w_in_out);

}  // namespace flowrun
