// Expert parallel (run.parallel.ep; issue 73): a mixture of experts' experts split over the ep
// ranks of the mesh (parallel/mesh.hpp: cut out of dp), each token sent to the rank holding its
// expert and its output sent back, by two all-to-alls of uneven counts (GShard, Lepikhin et al.
// 2020; torchtitan's and Megatron-LM's expert parallel):
//
//   rank r of ep R holds experts [r E/R, (r + 1) E/R) of every sparse layer (the tensors'
//   dim 0: models/moe.hpp). Its tokens' (token, expert) pairs, sorted by expert, are already
//   grouped by the rank that holds the expert:
//     counts [E] ─ all-to-all of counts ─> what each rank sends this one, per local expert
//     rows ─ dispatch (all_to_all_rows) ─> regrouped by local expert ─ grouped experts ─
//       back in arrival order ─ combine (all_to_all_rows, the counts swapped) ─> rows in pair order
//
// The router, attention and every dense layer stay replicated over the ep ranks; each rank routes
// its own tokens. An expert's gradient holds what every ep rank's tokens gave it; averaged over
// the ranks that hold the same experts (the edp group) it is the data-parallel average.
//
// Whose channel: as tensor parallel's (collectives.hpp ThreadChannel), a node that runs the model
// opens its own group over its ep ranks (own_ep_group, EpChannel; its schema declares
// `collectives: { group: ep }`) around its work; the model holds only its place among them
// (Group::place) and finds the channel with thread_channel(Dim::ep, ...).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "parallel/collectives.hpp"

namespace flowrun {
struct RunInfo;
}

namespace flowrun::parallel {

// The node's own channel over its ep ranks, open on this thread (collectives.hpp ThreadChannel).
class EpChannel : public ThreadChannel {
 public:
  explicit EpChannel(Group* g) : ThreadChannel(Dim::ep, g) {}
};

// A node's own group over its ep ranks (setup: collective over the world); null at ep 1.
std::shared_ptr<Group> own_ep_group(const std::string& node, const RunInfo& run);
// The same over the ranks that hold the same experts (dp / ep of them; an expert's gradient is
// averaged over them); null without expert parallel (ep 1) or when there is one.
std::shared_ptr<Group> own_edp_group(const std::string& node, const RunInfo& run);

// Rows of x [sum send_rows, ...] all-to-all over `g`: send_rows[q] rows to rank q, recv_rows[q]
// from it, in rank order. Differentiable: backward sends the gradients back (the counts swapped).
torch::Tensor all_to_all_rows(const torch::Tensor& x, const std::vector<int64_t>& send_rows,
                              const std::vector<int64_t>& recv_rows, Group& g);

// The seconds this rank spent in the all-to-alls of rows and counts over `g` (waiting for them
// included) since the last call: what forward_backward reports as a step's experts/a2a_ms.
double take_exchange_seconds(const Group& g);

// What each rank sends this one: `mine` [ep, L] (this rank's pair counts for rank q's L experts in
// row q) exchanged: row q of the result is rank q's counts for this rank's L experts. Not
// differentiable (counts).
torch::Tensor exchange_counts(const torch::Tensor& mine, Group& g);

}  // namespace flowrun::parallel
