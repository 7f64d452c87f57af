// A mixture-of-experts MLP (issue 73), as transformers 5 lays out Qwen 3 MoE's and Mixtral's:
//
//   gate.weight              [experts, dim]            the router (transformers' TopKRouter)
//   experts.gate_up_proj     [experts, 2 * hidden, dim] each expert's SwiGLU gate and up rows
//   experts.down_proj        [experts, dim, hidden]     each expert's down projection
//
// Each token's router logits (gate x) are softmaxed in float32; its top_k experts are taken
// (renormalised to sum to 1 with norm_topk_prob, as Qwen 3 MoE's option and Mixtral always do),
// and the token's output is the weighted sum of those experts' SwiGLU MLPs. Dropless: every token
// goes to each of its top_k experts. The (token, expert) pairs are sorted by expert, so each
// expert's rows are one contiguous run, and each projection is one grouped product over the runs
// (grouped_linear: a matrix product per run, into one output, and in backward each expert's weight
// gradient written in place), never a product over masks.
//
// Expert parallel (Options::ep, parallel/expert_parallel.hpp): the module holds experts
// [r E/R, (r + 1) E/R) of the R ep ranks (its tensors' dim 0), routes its own tokens over all E
// and sends each (token, expert) pair's row to the expert's rank and the output back.
//
// Files saved per expert (save_pretrained's "original format", the Hub's files:
// mlp.experts.E.gate_proj.weight, Mixtral's block_sparse_moe.experts.E.w1.weight) are fused into
// these tensors as they are read (fuse_experts).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "parallel/collectives.hpp"

namespace flowrun::moe {

// y [M, out]: rows [ends[g - 1], ends[g]) of x [M, in] times w[g]ᵀ (w [G, out, in], torch's
// layout; ends: G cumulative row counts, ends[G - 1] = M). Differentiable in x and w; an expert
// that no row reaches gets a zero gradient.
torch::Tensor grouped_linear(const torch::Tensor& x, const torch::Tensor& w, const std::vector<int64_t>& ends);

struct Options {
  int64_t dim = 0, hidden = 0, experts = 0, top_k = 0;
  bool norm_topk_prob = true;
  // This rank's place among the ep ranks (null or of one: every expert here); ep divides experts.
  std::shared_ptr<parallel::Group> ep;
  int64_t ep_size() const { return ep ? ep->size() : 1; }
  int64_t local_experts() const { return experts / ep_size(); }
};

// What one forward routed, for the load-balancing loss and the metrics.
struct Routing {
  torch::Tensor logits;  // [tokens, experts], the router's (with autograd)
  torch::Tensor counts;  // [experts] int64: the (token, expert) pairs each expert got
};

// A module that holds parameters only, for their names (gate.weight; experts.gate_up_proj, ...).
class HolderImpl : public torch::nn::Cloneable<HolderImpl> {
 public:
  explicit HolderImpl(std::vector<std::pair<std::string, std::vector<int64_t>>> shapes) : shapes_(std::move(shapes)) { reset(); }
  void reset() override;
  // The parameter of that name, looked up each time: a clone, or ZeRO-3's gathering, replaces them.
  torch::Tensor operator[](const std::string& name) const;

 private:
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes_;
};
TORCH_MODULE(Holder);

class MoeImpl : public torch::nn::Cloneable<MoeImpl> {
 public:
  explicit MoeImpl(Options o) : o_(o) { reset(); }
  void reset() override;
  // x [tokens, dim] -> [tokens, dim]; `routing`, when given, gets what the router decided.
  torch::Tensor forward(const torch::Tensor& x, Routing* routing = nullptr);
  const Options& options() const { return o_; }
  Holder gate{nullptr}, experts{nullptr};  // gate.weight; experts.gate_up_proj, experts.down_proj (this rank's)

 private:
  // The experts' SwiGLU over rows sorted by expert (ends: each local expert's last row + 1).
  torch::Tensor run_experts(const torch::Tensor& rows, const std::vector<int64_t>& ends);
  // Under ep: the rows (sorted by expert, counts [experts] of them each) to their experts' ranks,
  // through them, and back in the same order.
  torch::Tensor run_experts_parallel(const torch::Tensor& rows, const torch::Tensor& counts);
  Options o_;
};
TORCH_MODULE(Moe);

// transformers' load_balancing_loss_func (Switch Transformer's auxiliary loss) over the router
// logits of every sparse layer of one forward, concatenated: experts x sum over (k, e) of the
// fraction of the tokens whose k-th choice is e times the mean router probability of e.
torch::Tensor load_balancing_loss(const std::vector<torch::Tensor>& logits, int64_t experts, int64_t top_k);

// ST-MoE's router z-loss (Zoph et al. 2022) over the router logits of every sparse layer of one
// forward, concatenated: the mean over their rows of logsumexp(row)², in float32. Small logits keep
// the router's softmax away from the float limits (bf16 most of all); weighted by router_z_loss.
torch::Tensor router_z_loss(const std::vector<torch::Tensor>& logits);

// What a step's routing looks like (the first thing an MoE user looks at: a collapsed router sends
// most tokens to a few experts), from the tokens each expert got, counts [sparse layers, experts]:
// "balance" the most loaded expert's tokens over the mean, in the worst layer (1: even; experts /
// top_k: all to the same top_k), "unused" the (layer, expert) pairs that got no token, and per
// layer N "layerN.max_share" the most loaded expert's share of that layer's tokens (%).
std::vector<std::pair<std::string, double>> load_metrics(const torch::Tensor& counts, const std::vector<int64_t>& layers);

// How a family's files name the experts one by one: PREFIX.experts.E.GATE.weight etc., with PREFIX
// the layer's MLP in the file (Qwen 3 MoE: "mlp", Mixtral: "block_sparse_moe") and the module's
// ("mlp").
struct PerExpertNames {
  std::string file_prefix, gate, up, down;  // e.g. "block_sparse_moe", "w1", "w3", "w2"
};
// The per-expert tensors of every layer in `tensors` (HF's names) fused into the module's
// (model.layers.N.mlp.experts.gate_up_proj [E, 2 * hidden, dim], .down_proj [E, dim, hidden]) and
// the router renamed from the file's prefix (model.layers.N.FILE_PREFIX.gate.weight ->
// model.layers.N.mlp.gate.weight); everything else as it was. An expert missing among others, or
// of another shape, is an error naming it.
std::map<std::string, torch::Tensor> fuse_experts(const std::map<std::string, torch::Tensor>& tensors,
                                                  const PerExpertNames& names);
// The inverse, for saving as the Hub's files are: each layer's fused experts one by one under the
// file's names (contiguous copies), the router under the file's prefix.
std::map<std::string, torch::Tensor> split_experts(const std::map<std::string, torch::Tensor>& tensors,
                                                   const PerExpertNames& names);

}  // namespace flowrun::moe
