// Comparing a float32 result with a reference computed another way (another kernel, another
// order of summation, float64). A float32 reduction's rounding grows with the number and size of
// the terms it sums, and it differs by CPU: ATen's kernels by ATEN_CPU_CAPABILITY's vector width,
// a BLAS by its blocking (OpenBLAS's kernels by the core it finds, MKL's by the ISA). So a fixed
// absolute tolerance that passes on one CPU fails on the next; these bounds are relative to the
// largest magnitude of the reference: of the tensor, or of a whole set such as a model's
// gradients, where an element that is zero in exact arithmetic (the key projection's bias
// gradient: softmax ignores a constant added to a row of scores) holds rounding noise the size
// of its neighbours' terms.
#pragma once
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <vector>

namespace flowrun::test {

// max |got - want| <= rel * max(floor, max |want|), in float64.
inline void expect_close(const torch::Tensor& got, const torch::Tensor& want, double rel, const std::string& what,
                         double floor = 0) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  if (want.numel() == 0) return;
  const torch::Tensor w = want.to(torch::kDouble);
  const double scale = std::max(floor, w.abs().max().item<double>());
  const double diff = (got.to(torch::kDouble) - w).abs().max().item<double>();
  EXPECT_LE(diff, rel * scale) << what << ": max |difference| " << diff << ", bound " << rel << " x " << scale;
}

// The same for a set (every gradient of a model, say) against one scale: its largest |want|.
inline void expect_all_close(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want, double rel,
                             const std::vector<std::string>& names) {
  ASSERT_EQ(got.size(), want.size());
  ASSERT_EQ(names.size(), want.size());
  double scale = 0;
  for (const auto& w : want) scale = std::max(scale, w.numel() ? w.abs().max().item<double>() : 0.0);
  for (size_t i = 0; i < got.size(); ++i) expect_close(got[i], want[i], rel * (scale > 0 ? 1 : 0), names[i], scale);
}

}  // namespace flowrun::test
