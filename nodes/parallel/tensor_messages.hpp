// Named tensors from one rank to another over a group's point-to-point messages
// (collectives.hpp): a pipeline stage's activations and their gradients, a stage's state to
// rank 0 for a checkpoint's exports. The receiver need not know the shapes: each message is a
// header (its label, and each tensor's name, dtype and shape, on the host) followed by the
// tensors themselves (CPU tensors over MPI, CUDA ones over NCCL, on the device the receiver asks
// for).
//
//   Outbox out;                                   // keeps what is in flight alive
//   send_tensors(group, peer, "act F3.1", {{"x", x}}, out);   // returns at once
//   Message m = recv_tensors(group, peer, device);            // waits for the header, then the tensors
//   m.label == "act F3.1"; m.tensors.at("x")
//   out.wait();                                   // before the tensors sent may change
//
// Messages between two ranks pair up in the order each side issues them (collectives.hpp), so a
// receiver that needs them in another order keeps the early ones (the label says which is which).
#pragma once
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "parallel/collectives.hpp"

namespace flowrun::parallel {

using NamedTensors = std::map<std::string, torch::Tensor>;

// Sends in flight and the buffers they read.
class Outbox {
 public:
  void add(Work w, torch::Tensor keep) { works_.emplace_back(std::move(w), std::move(keep)); }
  // Waits for every send (MPI: the host; NCCL: the current stream), then lets go of the buffers.
  void wait();
  // Lets go of the ones that ended (a host poll).
  void prune();

 private:
  std::vector<std::pair<Work, torch::Tensor>> works_;
};

struct Message {
  std::string label;
  NamedTensors tensors;
};

// `tensors` (defined, contiguous copies are made of others) to group rank `peer`, labelled.
void send_tensors(Group& group, int peer, const std::string& label, const NamedTensors& tensors, Outbox& out);
// The next message from group rank `peer`, its tensors on `device`; waits for all of it.
Message recv_tensors(Group& group, int peer, const torch::Device& device);
// The same in two halves, so that the wait for a message's header overlaps other work: post()
// asks for the next message's header from `peer` now (messages from a peer pair up in the order
// their receives are posted), take() waits for it and receives the tensors.
class Incoming {
 public:
  Incoming(Group& group, int peer);
  Message take(const torch::Device& device);

 private:
  Group* group_;
  int peer_;
  torch::Tensor header_;
  Work work_;
};

// A state cut over pipeline stages, gathered on the group's rank 0 (collective over `group`: every
// member, in the same order): each other rank sends its tensors, rank 0 receives them rank by rank
// and returns its own and theirs (a name two stages hold, a tied copy, from the first that has it);
// the others return nothing.
NamedTensors gather_on_first(Group& group, const NamedTensors& mine, const std::string& what);

}  // namespace flowrun::parallel
