// The computation behind the shapes_fidelity node, usable on its own (tests, scripts).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace flowrun {

// What the images of one caption showed: how many there were and how many passed each of
// score_shape_image's checks (data/shapes.hpp): the three of prompt fidelity, and the kind.
struct PromptTally {
  std::string caption;
  int64_t samples = 0, background = 0, color = 0, size = 0, kind = 0;
  // Fidelity's checks (background, color, size) passed, in % of the 3 per image; NaN without images.
  double percent() const;
  // One check's share of the images, in % (NaN without images).
  double share(int64_t passed) const;
};

// Scores images [N, 3, H, W] in [-1, 1] (any device, square, at least 8x8) against their
// captions (N, in shape_caption's words): one tally per distinct caption, in the order of first
// appearance. Errors name the caption that does not parse and what is wrong with the images.
std::vector<PromptTally> score_captioned_images(const torch::Tensor& images, const std::vector<std::string>& captions);

}  // namespace flowrun
