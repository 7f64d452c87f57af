// A VAE's configuration as graph files state it: the shared autoencoder_kl parameter group
// (schemas/groups/autoencoder_kl.yaml) of the vae, vae_encode and sampler nodes, or a diffusers
// AutoencoderKL folder's config.json. Beside the model (vae.hpp), for every node that builds one.
#pragma once
#include <yaml-cpp/yaml.h>

#include <string>

#include "models/vae/vae.hpp"
#include "node.hpp"  // Params

namespace flowrun {

// The architecture a node states with the shared autoencoder_kl group
// (schemas/groups/autoencoder_kl.yaml): vae_encode's own parameters, sampler's `vae` map. With
// the group's `pretrained` (a diffusers AutoencoderKL folder, or a pipeline's: its vae/), the
// sizes come from its config.json, each one `written` (the group's parameters as the graph
// wrote them) must agree, and *pretrained_weights is set to its weights file; throws
// std::runtime_error naming the file otherwise.
vae::Config autoencoder_kl_config(const Params& group_params, const YAML::Node& written = YAML::Node(),
                                  std::string* pretrained_weights = nullptr);

}  // namespace flowrun
