// Images (formats/image_io.hpp, torch-free) as tensors and back: what the image data node feeds
// models and what samplers write.
#pragma once
#include <torch/torch.h>

#include <cstdint>

#include "formats/image_io.hpp"

namespace flowrun {

// RGB image -> float32 [3, H, W] in [-1, 1] (x / 127.5 - 1).
torch::Tensor image_to_tensor(const Image& img);
// float [3, H, W] in [-1, 1] (clamped) or uint8 [H, W, 3] -> RGB Image. For samplers: write_png(path, tensor_to_image(x)).
Image tensor_to_image(const torch::Tensor& t);
// float [N, 3, H, W] in [-1, 1] -> one image of the N tiles in rows of `cols`, `pad` pixels of
// `pad_value` (0..255) between them.
Image image_grid(const torch::Tensor& images, int cols, int pad = 2, uint8_t pad_value = 255);

}  // namespace flowrun
