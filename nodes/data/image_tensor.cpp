// Images <-> tensors (image_tensor.hpp).
#include "data/image_tensor.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace flowrun {

torch::Tensor image_to_tensor(const Image& img) {
  if (img.c != 3) throw std::invalid_argument("image_to_tensor: needs an RGB image, got " + std::to_string(img.c) + " channels");
  torch::Tensor t = torch::empty({3, img.h, img.w}, torch::kFloat32);
  float* out = t.data_ptr<float>();
  const size_t plane = static_cast<size_t>(img.h) * img.w;
  for (size_t p = 0; p < plane; ++p)
    for (int k = 0; k < 3; ++k) out[k * plane + p] = img.px[p * 3 + k] / 127.5f - 1.f;
  return t;
}

Image tensor_to_image(const torch::Tensor& t_in) {
  torch::Tensor t = t_in.detach().to(torch::kCPU);
  if (t.scalar_type() == torch::kUInt8) {
    if (t.dim() != 3 || t.size(2) != 3) throw std::invalid_argument("tensor_to_image: a uint8 image is [H, W, 3]");
  } else {
    if (t.dim() != 3 || t.size(0) != 3) throw std::invalid_argument("tensor_to_image: a float image is [3, H, W] in [-1, 1]");
    t = ((t.to(torch::kFloat32).clamp(-1, 1) + 1) * 127.5).round().to(torch::kUInt8).permute({1, 2, 0});
  }
  t = t.contiguous();
  Image img(static_cast<int>(t.size(1)), static_cast<int>(t.size(0)), 3);
  std::memcpy(img.px.data(), t.data_ptr<uint8_t>(), img.px.size());
  return img;
}

Image image_grid(const torch::Tensor& images, int cols, int pad, uint8_t pad_value) {
  if (images.dim() != 4 || images.size(1) != 3) throw std::invalid_argument("image_grid: images are [N, 3, H, W]");
  const int n = static_cast<int>(images.size(0)), h = static_cast<int>(images.size(2)), w = static_cast<int>(images.size(3));
  if (n < 1 || cols < 1) throw std::invalid_argument("image_grid: no images, or cols < 1");
  cols = std::min(cols, n);
  const int rows = (n + cols - 1) / cols;
  Image grid(cols * w + (cols + 1) * pad, rows * h + (rows + 1) * pad, 3, pad_value);
  for (int i = 0; i < n; ++i) {
    const Image tile = tensor_to_image(images[i]);
    const int x0 = pad + (i % cols) * (w + pad), y0 = pad + (i / cols) * (h + pad);
    for (int y = 0; y < h; ++y) std::memcpy(grid.at(x0, y0 + y), tile.at(0, y), static_cast<size_t>(w) * 3);
  }
  return grid;
}

}  // namespace flowrun
