// Expert parallel's exchanges (expert_parallel.hpp).
#include "parallel/expert_parallel.hpp"

#include <chrono>
#include <map>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "node.hpp"  // RunInfo

namespace flowrun::parallel {

namespace {

// Time in the exchanges, per group (forward and backward may run on different threads).
std::mutex g_spent_mu;
std::map<const Group*, double> g_spent;

// Runs `exchange` and adds its wall time to the group's.
template <class Fn>
auto timed(const Group& g, Fn exchange) {
  const auto t0 = std::chrono::steady_clock::now();
  auto out = exchange();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::lock_guard<std::mutex> lock(g_spent_mu);
  g_spent[&g] += s;
  return out;
}

struct AllToAllRows : torch::autograd::Function<AllToAllRows> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows, Group* g) {
    ctx->saved_data["send"] = c10::List<int64_t>(send_rows);
    ctx->saved_data["recv"] = c10::List<int64_t>(recv_rows);
    ctx->saved_data["group"] = reinterpret_cast<int64_t>(g);  // lives as long as its node (tensor_parallel.cpp)
    return exchange(x, send_rows, recv_rows, *g, "expert parallel: tokens to their experts' ranks");
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad) {
    Group& g = *reinterpret_cast<Group*>(ctx->saved_data["group"].toInt());
    return {exchange(grad[0], ctx->saved_data["recv"].toIntVector(), ctx->saved_data["send"].toIntVector(), g,
                     "expert parallel: the gradients back to their tokens' ranks"),
            torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
  static torch::Tensor exchange(const torch::Tensor& x, const std::vector<int64_t>& send_rows,
                                const std::vector<int64_t>& recv_rows, Group& g, const char* what) {
    int64_t rows = 0;
    for (int64_t r : recv_rows) rows += r;
    std::vector<int64_t> shape = x.sizes().vec();
    shape[0] = rows;
    const torch::Tensor in = x.contiguous();
    return timed(g, [&] {
      torch::Tensor out = torch::empty(shape, in.options());
      g.all_to_all(in, send_rows, out, recv_rows, what).wait();
      return out;
    });
  }
};

}  // namespace

std::shared_ptr<Group> own_ep_group(const std::string& node, const RunInfo& run) {
  const Mesh mesh = mesh_of(run);
  return mesh.size(Dim::ep) == 1 ? nullptr : Group::along(node, mesh, Dim::ep, run.rank);
}

std::shared_ptr<Group> own_edp_group(const std::string& node, const RunInfo& run) {
  const Mesh mesh = mesh_of(run);
  return mesh.size(Dim::ep) == 1 || mesh.size(Dim::edp) == 1 ? nullptr : Group::along(node, mesh, Dim::edp, run.rank);
}

torch::Tensor all_to_all_rows(const torch::Tensor& x, const std::vector<int64_t>& send_rows,
                              const std::vector<int64_t>& recv_rows, Group& g) {
  return AllToAllRows::apply(x, send_rows, recv_rows, &g);
}

torch::Tensor exchange_counts(const torch::Tensor& mine, Group& g) {
  if (mine.dim() != 2 || mine.size(0) != g.size())
    throw std::logic_error("expert parallel: counts " + c10::str(mine.sizes()) + " for " + std::to_string(g.size()) + " ranks");
  // As doubles (the collectives' types; exact up to 2^53 pairs).
  const torch::Tensor send = mine.to(torch::kCPU, torch::kDouble).contiguous();
  const std::vector<int64_t> one(static_cast<size_t>(g.size()), 1);
  return timed(g, [&] {
    torch::Tensor recv = torch::empty_like(send);
    g.all_to_all(send, one, recv, one, "expert parallel: each rank's token counts for this rank's experts").wait();
    return recv.to(torch::kLong);
  });
}

double take_exchange_seconds(const Group& g) {
  const std::lock_guard<std::mutex> lock(g_spent_mu);
  return std::exchange(g_spent[&g], 0.0);
}

}  // namespace flowrun::parallel
