#include "models/moe.hpp"

#include <spdlog/fmt/fmt.h>

#include <regex>
#include <stdexcept>

#include "common/tensor_map.hpp"
#include "models/linear.hpp"
#include "parallel/expert_parallel.hpp"

namespace flowrun::moe {

// ---- grouped_linear ----

namespace {

// Each run of rows by its own weight: forward y_g = x_g w_gᵀ; backward dx_g = dy_g w_g and
// dw_g = dy_gᵀ x_g, each written in place into one tensor (autograd through a select of w per
// run would allocate a whole-w zero gradient for every run).
struct GroupedLinear : public torch::autograd::Function<GroupedLinear> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const std::vector<int64_t>& ends) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["ends"] = c10::List<int64_t>(ends);
    torch::Tensor y = torch::empty({x.size(0), w.size(1)}, x.options());
    int64_t start = 0;
    for (size_t g = 0; g < ends.size(); ++g) {
      const int64_t n = ends[g] - start;
      if (n > 0) {
        torch::Tensor rows = y.narrow(0, start, n);
        torch::mm_out(rows, x.narrow(0, start, n), w[static_cast<int64_t>(g)].t());
      }
      start = ends[g];
    }
    return y;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &w = saved[1];
    const c10::List<int64_t> ends = ctx->saved_data["ends"].toIntList();
    const torch::Tensor dy = grads[0].contiguous();
    torch::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = torch::empty_like(x);
    if (ctx->needs_input_grad(1)) dw = torch::zeros_like(w);
    int64_t start = 0;
    for (size_t g = 0; g < ends.size(); ++g) {
      const int64_t n = ends[g] - start;
      if (n > 0) {
        const torch::Tensor d = dy.narrow(0, start, n);
        if (dx.defined()) {
          torch::Tensor rows = dx.narrow(0, start, n);
          torch::mm_out(rows, d, w[static_cast<int64_t>(g)]);
        }
        if (dw.defined()) {
          torch::Tensor expert = dw[static_cast<int64_t>(g)];
          torch::mm_out(expert, d.t(), x.narrow(0, start, n));
        }
      }
      start = ends[g];
    }
    return {dx, dw, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor grouped_linear(const torch::Tensor& x, const torch::Tensor& w, const std::vector<int64_t>& ends) {
  if (x.dim() != 2 || w.dim() != 3 || x.size(1) != w.size(2) || static_cast<int64_t>(ends.size()) != w.size(0) ||
      (ends.empty() ? 0 : ends.back()) != x.size(0))
    throw std::logic_error(fmt::format("grouped_linear: x {} by w {} in {} runs ending at {}", shape_str(x), shape_str(w),
                                       ends.size(), ends.empty() ? 0 : ends.back()));
  // Under autocast (run.precision bf16) the weights in the input's precision, as a linear layer's
  // are; their gradient flows back through the cast to the float32 parameters.
  return GroupedLinear::apply(x.contiguous(), w.scalar_type() == x.scalar_type() ? w : w.to(x.scalar_type()), ends);
}

// ---- the module ----

void HolderImpl::reset() {
  for (const auto& [name, shape] : shapes_) register_parameter(name, torch::empty(shape));
}

torch::Tensor HolderImpl::operator[](const std::string& name) const {
  const torch::Tensor* p = named_parameters(/*recurse=*/false).find(name);
  if (!p) throw std::logic_error("moe: no parameter " + name);
  return *p;
}

void MoeImpl::reset() {
  if (o_.dim <= 0 || o_.hidden <= 0 || o_.experts <= 0 || o_.top_k <= 0 || o_.top_k > o_.experts)
    throw std::runtime_error(fmt::format("moe: experts {} (top {}), each {} x {}: every size positive and top_k at most "
                                         "the experts", o_.experts, o_.top_k, o_.dim, o_.hidden));
  if (o_.experts % o_.ep_size() != 0)
    throw std::runtime_error(fmt::format("moe: {} experts do not split over ep {} (run.parallel.ep); choose an ep dividing "
                                         "the experts", o_.experts, o_.ep_size()));
  const int64_t local = o_.local_experts();
  gate = register_module("gate", Holder(std::vector<std::pair<std::string, std::vector<int64_t>>>{{"weight", {o_.experts, o_.dim}}}));
  experts = register_module("experts", Holder(std::vector<std::pair<std::string, std::vector<int64_t>>>{
                                           {"gate_up_proj", {local, 2 * o_.hidden, o_.dim}},
                                           {"down_proj", {local, o_.dim, o_.hidden}}}));
}

torch::Tensor MoeImpl::forward(const torch::Tensor& x, Routing* routing) {
  const int64_t N = x.size(0), K = o_.top_k;
  // The router: float32 probabilities, each token's top K (as transformers' TopKRouter).
  const torch::Tensor logits = flowrun::linear(x, (*gate)["weight"]);
  auto [weights, chosen] = torch::softmax(logits, -1, torch::kFloat).topk(K, -1);
  if (o_.norm_topk_prob) weights = weights / weights.sum(-1, /*keepdim=*/true);
  // The (token, expert) pairs sorted by expert (stable: a token's rows in token order), and each
  // expert's run of them.
  const torch::Tensor pairs = chosen.reshape({N * K});
  const torch::Tensor order = std::get<1>(pairs.sort(/*stable=*/true, 0, /*descending=*/false));
  const torch::Tensor token = order.div(K, "floor");
  const torch::Tensor counts = torch::bincount(pairs, {}, o_.experts);
  const torch::Tensor rows = x.index_select(0, token);
  torch::Tensor y;
  if (o_.ep_size() > 1) {
    y = run_experts_parallel(rows, counts);
  } else {
    const torch::Tensor ends_t = counts.cumsum(0).to(torch::kCPU);
    y = run_experts(rows, std::vector<int64_t>(ends_t.data_ptr<int64_t>(), ends_t.data_ptr<int64_t>() + o_.experts));
  }
  // Each pair's output weighted, summed back into its token's row.
  y = y * weights.reshape({N * K}).index_select(0, order).unsqueeze(1);
  if (routing) *routing = {logits, counts};
  return torch::zeros({N, x.size(1)}, y.options()).index_add(0, token, y).to(x.scalar_type());
}

torch::Tensor MoeImpl::run_experts(const torch::Tensor& rows, const std::vector<int64_t>& ends) {
  const int64_t H = o_.hidden;
  const torch::Tensor gu = grouped_linear(rows, (*experts)["gate_up_proj"], ends);
  const torch::Tensor h = torch::silu(gu.narrow(1, 0, H)) * gu.narrow(1, H, H);
  return grouped_linear(h, (*experts)["down_proj"], ends);
}

torch::Tensor MoeImpl::run_experts_parallel(const torch::Tensor& rows, const torch::Tensor& counts) {
  parallel::Group& g = parallel::thread_channel(parallel::Dim::ep, o_.ep, "expert parallel");
  const int64_t R = o_.ep_size(), L = o_.local_experts();
  // What this rank sends each rank (its pairs for that rank's experts: consecutive, sorted by
  // expert) and what each sends it, per local expert: [R, L], row q from rank q.
  const torch::Tensor mine = counts.to(torch::kCPU).view({R, L});
  const torch::Tensor theirs = parallel::exchange_counts(mine, g);
  auto as_vector = [](const torch::Tensor& t) {
    const torch::Tensor c = t.contiguous();
    return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  };
  const std::vector<int64_t> send = as_vector(mine.sum(1)), recv = as_vector(theirs.sum(1));
  const torch::Tensor arrived = parallel::all_to_all_rows(rows, send, recv, g);
  // Arrived by source rank, then by expert within each: block (q, e) starts at start[q][e].
  // Regrouped by expert, then by source (each expert's rows one run): position p of the new
  // order takes arrived row by_expert[p].
  const torch::Tensor sizes = theirs.reshape({R * L});
  const torch::Tensor start = (sizes.cumsum(0) - sizes).view({R, L});
  const torch::Tensor lens = theirs.t().reshape({R * L}), firsts = start.t().reshape({R * L});
  const torch::Tensor total = lens.sum();
  const torch::Tensor block_start = lens.cumsum(0) - lens;  // where each (e, q) block begins in the new order
  const torch::Tensor p = torch::arange(total.item<int64_t>(), torch::kLong);
  const torch::Tensor by_expert = (torch::repeat_interleave(firsts, lens) + p - torch::repeat_interleave(block_start, lens))
                                      .to(rows.device());
  const torch::Tensor ends_t = theirs.sum(0).cumsum(0);
  const torch::Tensor out = run_experts(arrived.index_select(0, by_expert), as_vector(ends_t));
  // Back in arrival order, then to the ranks the rows came from.
  const torch::Tensor back = torch::zeros_like(out).index_copy(0, by_expert, out);
  return parallel::all_to_all_rows(back, recv, send, g);
}

torch::Tensor load_balancing_loss(const std::vector<torch::Tensor>& logits, int64_t experts, int64_t top_k) {
  if (logits.empty()) throw std::logic_error("load_balancing_loss: no router logits");
  const torch::Tensor all = torch::cat(logits, 0).to(torch::kFloat);
  const torch::Tensor probs = torch::softmax(all, -1);
  const torch::Tensor chosen = std::get<1>(probs.topk(top_k, -1));                        // [rows, k]
  const torch::Tensor mask = torch::one_hot(chosen, experts).to(torch::kFloat);          // [rows, k, E]
  const torch::Tensor tokens_per_expert = mask.mean(0);                                  // [k, E]
  const torch::Tensor prob_per_expert = probs.mean(0);                                   // [E]
  return (tokens_per_expert * prob_per_expert.unsqueeze(0)).sum() * static_cast<double>(experts);
}

torch::Tensor router_z_loss(const std::vector<torch::Tensor>& logits) {
  if (logits.empty()) throw std::logic_error("router_z_loss: no router logits");
  return torch::cat(logits, 0).to(torch::kFloat).logsumexp(-1).square().mean();
}

std::vector<std::pair<std::string, double>> load_metrics(const torch::Tensor& counts, const std::vector<int64_t>& layers) {
  const torch::Tensor c = counts.to(torch::kCPU, torch::kDouble);
  if (c.dim() != 2 || c.size(0) != static_cast<int64_t>(layers.size()))
    throw std::logic_error("moe::load_metrics: counts " + shape_str(counts) + " for " + std::to_string(layers.size()) + " layers");
  const torch::Tensor top = std::get<0>(c.max(1)), total = c.sum(1);
  const torch::Tensor mean = total / static_cast<double>(c.size(1));
  std::vector<std::pair<std::string, double>> out = {
      {"balance", (top / mean.clamp_min(1e-12)).max().item<double>()},
      {"unused", static_cast<double>((c == 0).sum().item<int64_t>())}};
  for (size_t l = 0; l < layers.size(); ++l)
    out.emplace_back("layer" + std::to_string(layers[l]) + ".max_share",
                     100.0 * top[static_cast<int64_t>(l)].item<double>() / std::max(1.0, total[static_cast<int64_t>(l)].item<double>()));
  return out;
}

// ---- files saved per expert ----

std::map<std::string, torch::Tensor> fuse_experts(const std::map<std::string, torch::Tensor>& tensors,
                                                  const PerExpertNames& names) {
  const std::regex expert("(model\\.layers\\.\\d+)\\." + names.file_prefix + "\\.experts\\.(\\d+)\\.(" + names.gate + "|" +
                          names.up + "|" + names.down + ")\\.weight");
  const std::regex router("(model\\.layers\\.\\d+)\\." + names.file_prefix + "\\.gate\\.weight");
  std::map<std::string, std::map<int64_t, std::map<std::string, torch::Tensor>>> layers;  // layer -> expert -> part
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : tensors) {
    std::smatch m;
    if (std::regex_match(name, m, expert)) {
      layers[m[1].str()][std::stoll(m[2].str())][m[3].str()] = t;
    } else if (std::regex_match(name, m, router)) {
      out[m[1].str() + ".mlp.gate.weight"] = t;
    } else {
      out[name] = t;
    }
  }
  for (const auto& [layer, experts] : layers) {
    std::vector<torch::Tensor> gate_up, down;
    int64_t e = 0;
    for (const auto& [index, parts] : experts) {
      if (index != e)
        throw std::runtime_error(fmt::format("{}.{}.experts.{}: missing (the experts found: {} ... {}); every expert of the "
                                             "layer must be in the files", layer, names.file_prefix, e,
                                             experts.begin()->first, experts.rbegin()->first));
      for (const std::string& part : {names.gate, names.up, names.down})
        if (!parts.count(part))
          throw std::runtime_error(fmt::format("{}.{}.experts.{}.{}.weight is missing", layer, names.file_prefix, e, part));
      const torch::Tensor &g = parts.at(names.gate), &u = parts.at(names.up), &d = parts.at(names.down);
      if (g.dim() != 2 || !g.sizes().equals(u.sizes()) || d.dim() != 2 || d.size(0) != g.size(1) || d.size(1) != g.size(0))
        throw std::runtime_error(fmt::format("{}.{}.experts.{}: {} {}, {} {} and {} {} are not an expert's gate [hidden, dim], "
                                             "up [hidden, dim] and down [dim, hidden]", layer, names.file_prefix, e, names.gate,
                                             shape_str(g), names.up, shape_str(u), names.down, shape_str(d)));
      gate_up.push_back(torch::cat({g, u.to(g.scalar_type())}, 0));
      down.push_back(d);
      ++e;
    }
    out[layer + ".mlp.experts.gate_up_proj"] = torch::stack(gate_up);
    out[layer + ".mlp.experts.down_proj"] = torch::stack(down);
  }
  return out;
}

std::map<std::string, torch::Tensor> split_experts(const std::map<std::string, torch::Tensor>& tensors,
                                                   const PerExpertNames& names) {
  static const std::regex fused(R"((model\.layers\.\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight))");
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : tensors) {
    std::smatch m;
    if (!std::regex_match(name, m, fused)) {
      out[name] = t;
      continue;
    }
    const std::string layer = m[1].str() + "." + names.file_prefix, what = m[2].str();
    if (what == "gate.weight") {
      out[layer + ".gate.weight"] = t;
      continue;
    }
    for (int64_t e = 0; e < t.size(0); ++e) {
      const std::string expert = layer + ".experts." + std::to_string(e) + ".";
      if (what == "experts.down_proj") {
        out[expert + names.down + ".weight"] = t[e].contiguous();
      } else {
        const int64_t h = t.size(1) / 2;
        out[expert + names.gate + ".weight"] = t[e].narrow(0, 0, h).contiguous();
        out[expert + names.up + ".weight"] = t[e].narrow(0, h, h).contiguous();
      }
    }
  }
  return out;
}

}  // namespace flowrun::moe
