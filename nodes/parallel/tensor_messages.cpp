// Named tensors between two ranks (tensor_messages.hpp). A message is a header of kHeader bytes
// (the text's length, 8 bytes, then the text: the label, then per tensor a line "name", a line
// "dtype ndim d0 d1 ..."; a longer text's rest follows in a second send), then each tensor's bytes
// in the header's order (any dtype). A fixed-size header lets a receiver post its receive before
// the message is sent.
#include "parallel/tensor_messages.hpp"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>

namespace flowrun::parallel {

void Outbox::wait() {
  for (auto& [w, t] : works_) w.wait();
  works_.clear();
}

void Outbox::prune() {
  std::vector<std::pair<Work, torch::Tensor>> left;
  for (auto& item : works_)
    if (!item.first.done()) left.push_back(std::move(item));
  works_ = std::move(left);
}

namespace {

constexpr int64_t kHeader = 4096;
constexpr size_t kText = kHeader - 8;  // of the text in the fixed header

torch::Tensor bytes_of(const std::string& s) {
  torch::Tensor t = torch::empty({static_cast<int64_t>(s.size())}, torch::kUInt8);
  if (!s.empty()) std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}

}  // namespace

void send_tensors(Group& group, int peer, const std::string& label, const NamedTensors& tensors, Outbox& out) {
  std::ostringstream h;
  h << label << "\n" << tensors.size() << "\n";
  std::vector<torch::Tensor> data;
  for (const auto& [name, t] : tensors) {
    if (!t.defined()) throw std::logic_error("send_tensors '" + label + "': tensor '" + name + "' is undefined");
    if (name.find('\n') != std::string::npos) throw std::logic_error("send_tensors: a tensor name with a line break");
    h << name << "\n" << static_cast<int>(t.scalar_type()) << " " << t.dim();
    for (int64_t d : t.sizes()) h << " " << d;
    h << "\n";
    data.push_back(t.detach().contiguous().reshape({-1}).view(torch::kUInt8));  // any dtype, as its bytes
  }
  const std::string header = h.str();
  const uint64_t n = header.size();
  torch::Tensor fixed = torch::zeros({kHeader}, torch::kUInt8);
  auto* bytes = static_cast<char*>(fixed.data_ptr());
  std::memcpy(bytes, &n, 8);
  std::memcpy(bytes + 8, header.data(), std::min<size_t>(n, kText));
  const std::string what = "sending '" + label + "' to rank " + std::to_string(peer) + " of '" + group.name() + "'";
  out.add(group.send(fixed, peer, what), fixed);
  if (n > kText) {
    torch::Tensor rest = bytes_of(header.substr(kText));
    out.add(group.send(rest, peer, what), rest);
  }
  for (auto& t : data)
    if (t.numel() > 0) out.add(group.send(t, peer, what), t);
}

Incoming::Incoming(Group& group, int peer) : group_(&group), peer_(peer), header_(torch::empty({kHeader}, torch::kUInt8)) {
  work_ = group.recv(header_, peer, "receiving from rank " + std::to_string(peer) + " of '" + group.name() + "'");
}

Message Incoming::take(const torch::Device& device) {
  Group& group = *group_;
  const std::string what = "receiving from rank " + std::to_string(peer_) + " of '" + group.name() + "'";
  work_.wait();
  uint64_t n = 0;
  const auto* bytes = static_cast<const char*>(header_.data_ptr());
  std::memcpy(&n, bytes, 8);
  std::string text(bytes + 8, std::min<size_t>(n, kText));
  if (n > kText) {
    torch::Tensor rest = torch::empty({static_cast<int64_t>(n - kText)}, torch::kUInt8);
    group.recv(rest, peer_, what).wait();
    text.append(static_cast<const char*>(rest.data_ptr()), n - kText);
  }
  std::istringstream h(text);
  Message m;
  size_t count = 0;
  std::getline(h, m.label);
  h >> count;
  h.ignore(1);
  std::vector<Work> works;
  for (size_t i = 0; i < count; ++i) {
    std::string name;
    std::getline(h, name);
    int dtype = 0, dims = 0;
    h >> dtype >> dims;
    std::vector<int64_t> shape(static_cast<size_t>(dims));
    for (auto& d : shape) h >> d;
    h.ignore(1);
    if (!h) throw std::runtime_error(what + ": a malformed message header");
    torch::Tensor t = torch::empty(shape, torch::TensorOptions().dtype(static_cast<torch::ScalarType>(dtype)).device(device));
    if (t.numel() > 0) works.push_back(group.recv(t.view({-1}).view(torch::kUInt8), peer_, what + " ('" + m.label + "': " + name + ")"));
    m.tensors.emplace(std::move(name), std::move(t));
  }
  for (auto& w : works) w.wait();
  return m;
}

Message recv_tensors(Group& group, int peer, const torch::Device& device) { return Incoming(group, peer).take(device); }

NamedTensors gather_on_first(Group& group, const NamedTensors& mine, const std::string& what) {
  if (group.rank() != 0) {
    Outbox out;
    send_tensors(group, 0, what, mine, out);
    out.wait();
    return {};
  }
  NamedTensors all = mine;
  for (int q = 1; q < group.size(); ++q) {
    Message m = recv_tensors(group, q, torch::kCPU);
    if (m.label != what)
      throw std::logic_error("gathering '" + what + "' over '" + group.name() + "': rank " + std::to_string(q) + " sent '" +
                             m.label + "'");
    for (auto& [name, t] : m.tensors) all.emplace(name, std::move(t));
  }
  return all;
}

}  // namespace flowrun::parallel
