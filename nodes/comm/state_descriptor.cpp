#include "comm/state_descriptor.hpp"

#include "hash.hpp"

namespace flowrun {

std::string describe_tensors(const NamedTensors& tensors) {
  std::string out;
  for (const auto& [name, t] : tensors) {  // std::map: name order on every rank
    out += name;
    if (!t.defined()) {
      out += " undefined\n";
      continue;
    }
    out += ' ';
    out += c10::toString(t.scalar_type());
    out += " [";
    for (int64_t d = 0; d < t.dim(); ++d) out += (d ? ", " : "") + std::to_string(t.size(d));
    out += "]\n";
  }
  return out;
}

std::string first_difference(const std::string& rank0, const std::string& mine) {
  auto line = [](const std::string& d, size_t& pos) {
    if (pos >= d.size()) return std::string("nothing more");
    const size_t end = d.find('\n', pos);
    std::string l = d.substr(pos, end - pos);
    pos = end == std::string::npos ? d.size() : end + 1;
    return "'" + l + "'";
  };
  size_t a = 0, b = 0;
  while (a < rank0.size() || b < mine.size()) {
    std::string x = line(rank0, a), y = line(mine, b);
    if (x != y) return "rank 0 has " + x + " where this rank has " + y;
  }
  return "";
}

uint64_t descriptor_hash(const std::string& descriptor) { return fnv1a(descriptor); }

}  // namespace flowrun
