// A VAE's configuration from a graph's autoencoder_kl group or a diffusers folder (vae_config.hpp).
#include "models/vae/vae_config.hpp"

#include <map>
#include <set>
#include <stdexcept>

#include "common/pretrained.hpp"

namespace flowrun {

namespace {

// AutoencoderKL's config.json (diffusers v0.30) into the config: the group's parameters have
// diffusers' names; each one also written in the graph must agree. Keys that change the math
// must hold the one value this VAE computes with.
void apply_pretrained(const PretrainedFolder& f, const YAML::Node& written, vae::Config& c) {
  auto list_text = [](const std::vector<int64_t>& v) {
    std::string s;
    for (int64_t x : v) s += (s.empty() ? "[" : ", ") + std::to_string(x);
    return s + "]";
  };
  const auto channels = config_value<std::vector<int64_t>>(f, "block_out_channels", {64});
  if (written && written["block_out_channels"] && !written["block_out_channels"].IsNull()) {
    const auto ours = written["block_out_channels"].as<std::vector<int64_t>>();
    if (ours != channels)
      throw std::runtime_error("block_out_channels is " + list_text(ours) + " in the graph, " + f.config_path +
                               " has block_out_channels = " + list_text(channels) +
                               "; drop block_out_channels from the graph (the folder sets it) or use another folder");
  }
  c.block_out_channels = channels;
  c.layers_per_block = config_agreed<int64_t>(f, written, "layers_per_block", "layers_per_block", 1);
  c.latent_channels = config_agreed<int64_t>(f, written, "latent_channels", "latent_channels", 4);
  c.norm_num_groups = config_agreed<int64_t>(f, written, "norm_num_groups", "norm_num_groups", 32);
  c.in_channels = config_agreed<int64_t>(f, written, "in_channels", "in_channels", 3);
  c.out_channels = config_agreed<int64_t>(f, written, "out_channels", "out_channels", 3);
  c.scaling_factor = config_agreed<double>(f, written, "scaling_factor", "scaling_factor", 0.18215);
  const std::size_t n = c.block_out_channels.size();
  const std::map<std::string, nlohmann::json> fixed = {
      {"act_fn", "silu"},
      {"down_block_types", std::vector<std::string>(n, "DownEncoderBlock2D")},
      {"up_block_types", std::vector<std::string>(n, "UpDecoderBlock2D")},
      {"use_quant_conv", true},
      {"use_post_quant_conv", true},
      {"mid_block_add_attention", true},
      {"shift_factor", nullptr},
      {"latents_mean", nullptr},
      {"latents_std", nullptr}};
  const std::set<std::string> known = {"block_out_channels", "layers_per_block", "latent_channels", "norm_num_groups",
                                       "in_channels",        "out_channels",     "scaling_factor",  "sample_size",
                                       "force_upcast"};  // sample_size, force_upcast: how a pipeline runs it
  check_config_keys(f, known, fixed, "AutoencoderKL", "this VAE");
}

}  // namespace

vae::Config autoencoder_kl_config(const Params& v, const YAML::Node& written, std::string* pretrained_weights) {
  vae::Config c;
  c.block_out_channels = v.get<std::vector<int64_t>>("block_out_channels");
  v.read<int64_t>({{"layers_per_block", &c.layers_per_block}, {"latent_channels", &c.latent_channels},
                   {"norm_num_groups", &c.norm_num_groups}});
  c.scaling_factor = v.get<double>("scaling_factor");
  if (!v.has("pretrained")) return c;
  const PretrainedFolder f = open_pretrained(v.get<std::string>("pretrained"), {"vae", "AutoencoderKL", "diffusion_pytorch_model"});
  apply_pretrained(f, written, c);
  if (!f.weights_index.empty())
    throw std::runtime_error(f.weights_index + ": a sharded VAE is not read yet (a VAE is saved as one file; re-save it "
                             "with a larger max_shard_size)");
  if (pretrained_weights) *pretrained_weights = f.weight_files.front();
  return c;
}

}  // namespace flowrun
