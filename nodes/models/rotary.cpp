#include "models/rotary.hpp"

#include <cmath>
#include <stdexcept>

#include <spdlog/fmt/fmt.h>

namespace flowrun {

const char* RopeScaling::types() { return "default, linear, llama3"; }

void RopeScaling::check(const std::string& what) const {
  if (type != "default" && type != "linear" && type != "llama3")
    throw std::runtime_error(what + ": rope scaling type '" + type + "' is not built (built: " + types() + ")");
  if (type == "default") return;
  if (!(factor > 0)) throw std::runtime_error(what + ": rope scaling factor must be > 0, got " + fmt::format("{}", factor));
  if (type == "llama3") {
    if (original_context <= 0)
      throw std::runtime_error(what + ": llama3 rope scaling needs original_max_position_embeddings > 0");
    if (!(high_freq_factor > low_freq_factor) || !(low_freq_factor > 0))
      throw std::runtime_error(what + fmt::format(": llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, "
                                                  "got {} and {}", low_freq_factor, high_freq_factor));
  }
}

std::string RopeScaling::describe() const {
  if (type == "default") return "none";
  if (type == "linear") return fmt::format("linear (factor {})", factor);
  return fmt::format("llama3 (factor {}, low_freq_factor {}, high_freq_factor {}, original_context {})", factor,
                     low_freq_factor, high_freq_factor, original_context);
}

Rope::Rope(int64_t head_dim, double theta, const RopeScaling& s) {
  if (head_dim <= 0 || head_dim % 2 != 0)
    throw std::runtime_error("rotary embedding: head_dim must be even and positive, got " + std::to_string(head_dim));
  s.check("rotary embedding");
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  // transformers: 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), in float32
  const torch::Tensor exponent = torch::arange(0, head_dim, 2, torch::kInt64).to(torch::kFloat32) / static_cast<double>(head_dim);
  torch::Tensor inv = 1.0 / torch::pow(torch::scalar_tensor(theta, f32), exponent);
  if (s.type == "linear") {
    inv = inv / s.factor;
  } else if (s.type == "llama3") {
    const double old_context = static_cast<double>(s.original_context);
    const double low_freq_wavelen = old_context / s.low_freq_factor;
    const double high_freq_wavelen = old_context / s.high_freq_factor;
    const torch::Tensor wavelen = 2 * M_PI / inv;
    torch::Tensor scaled = torch::where(wavelen > low_freq_wavelen, inv / s.factor, inv);
    const torch::Tensor smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    const torch::Tensor smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
    const torch::Tensor medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
    inv = torch::where(medium, smoothed, scaled);
  }
  inv_freq_ = inv.contiguous();
}

std::pair<torch::Tensor, torch::Tensor> Rope::cos_sin(int64_t T, const torch::Device& device) const {
  // transformers: freqs = inv_freq[:, None] @ positions[None, :] in float32, emb = cat(freqs, freqs)
  const torch::Tensor positions = torch::arange(T, torch::TensorOptions().dtype(torch::kFloat32).device(device));
  const torch::Tensor freqs = torch::outer(positions, inv_freq_.to(device));
  const torch::Tensor emb = torch::cat({freqs, freqs}, -1);
  return {emb.cos(), emb.sin()};
}

torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const torch::Tensor rotated = torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos.to(x.scalar_type()) + rotated * sin.to(x.scalar_type());
}

}  // namespace flowrun
