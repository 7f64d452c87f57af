#include "state/checkpoint_read.hpp"

#include <algorithm>

#include "formats/crc32c.hpp"

namespace flowrun {

CheckpointReader::CheckpointReader(const std::string& folder) : folder_(folder), m_(ckpt::read_manifest(folder)) {
  if (m_.version >= 2) {
    if (const std::string p = ckpt::check_files(folder, m_); !p.empty()) throw DamagedCheckpoint("checkpoint " + folder + ": " + p);
    return;
  }
  // Version 1: one file per state, every tensor whole in it.
  for (const auto& [ref, file] : m_.states) {
    safetensors::File f;
    try {
      f = safetensors::map(folder + "/" + file);
    } catch (const std::exception& e) {
      throw DamagedCheckpoint(e.what());
    }
    auto& tensors = m_.tensors[ref];
    for (const auto& [name, t] : f.tensors) {
      ckpt::TensorEntry e;
      e.dtype = safetensors::dtype_name(t.scalar_type());
      e.shape = t.sizes().vec();
      e.chunks.push_back({file, name, std::vector<int64_t>(e.shape.size(), 0), e.shape, ""});
      tensors[name] = std::move(e);
    }
    mapped_[file] = std::move(f);
  }
}

torch::Tensor CheckpointReader::chunk(const ckpt::TensorEntry& t, const ckpt::Chunk& c, const std::string& name) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = mapped_.find(c.file);
  if (it == mapped_.end()) {
    try {
      it = mapped_.emplace(c.file, safetensors::map(folder_ + "/" + c.file)).first;
    } catch (const std::exception& e) {
      throw DamagedCheckpoint(e.what());
    }
  }
  const std::string path = folder_ + "/" + c.file;
  auto k = it->second.tensors.find(c.key);
  if (k == it->second.tensors.end())
    throw DamagedCheckpoint(path + " has no tensor '" + c.key + "', which the manifest says holds a chunk of '" + name + "'");
  const torch::Tensor& data = k->second;
  if (safetensors::dtype_name(data.scalar_type()) != t.dtype || data.sizes().vec() != c.sizes)
    throw DamagedCheckpoint(path + ": tensor '" + c.key + "' is " + safetensors::dtype_name(data.scalar_type()) + " " +
                            c10::str(data.sizes()) + ", the manifest says " + t.dtype + " " +
                            c10::str(c10::IntArrayRef(c.sizes)));
  if (!c.crc32c.empty() && !checked_[c.file + "/" + c.key]) {
    const torch::Tensor bytes = data.contiguous();
    const uint32_t crc = crc32c(bytes.data_ptr(), static_cast<size_t>(bytes.numel()) * bytes.element_size());
    if (crc32c_hex(crc) != c.crc32c)
      throw DamagedCheckpoint(path + ": the bytes of '" + c.key + "' (a chunk of '" + name + "') have CRC32C " +
                              crc32c_hex(crc) + ", the manifest says " + c.crc32c + " (changed after they were written)");
    checked_[c.file + "/" + c.key] = true;
  }
  return data;
}

// One state of the checkpoint, read box by box.
class CheckpointStateSource : public StateSource {
 public:
  CheckpointStateSource(const CheckpointReader& r, std::string ref) : r_(r), ref_(std::move(ref)), t_(r.m_.tensors.at(ref_)) {}
  std::vector<std::string> names() const override {
    std::vector<std::string> out;
    for (const auto& [name, _] : t_) out.push_back(name);
    return out;
  }
  bool has(const std::string& name) const override { return t_.count(name) > 0; }
  std::vector<int64_t> shape(const std::string& name) const override { return entry(name).shape; }
  torch::ScalarType dtype(const std::string& name) const override {
    return safetensors::dtype_from_name(entry(name).dtype, where() + ": '" + name + "'");
  }
  // Version 1: the state's file; version 2: the folder and the state (its files are the ranks').
  std::string where() const override {
    const auto it = r_.m_.states.find(ref_);
    return it != r_.m_.states.end() && !it->second.empty() ? r_.folder_ + "/" + it->second
                                                           : r_.folder_ + " (state " + ref_ + ")";
  }

  void read(const std::string& name, const std::vector<int64_t>& offsets, torch::Tensor into) const override {
    const ckpt::TensorEntry& e = entry(name);
    const std::vector<int64_t> sizes = into.sizes().vec();
    bool inside = offsets.size() == e.shape.size() && sizes.size() == e.shape.size();
    for (size_t d = 0; inside && d < sizes.size(); ++d) inside = offsets[d] >= 0 && offsets[d] + sizes[d] <= e.shape[d];
    if (!inside)
      throw std::runtime_error(where() + ": a box " + c10::str(c10::IntArrayRef(sizes)) + " at " +
                               c10::str(c10::IntArrayRef(offsets)) + " of '" + name + "', whose shape is " +
                               c10::str(c10::IntArrayRef(e.shape)));
    torch::NoGradGuard no_grad;
    int64_t covered = 0;
    for (const ckpt::Chunk& c : e.chunks) {
      std::vector<int64_t> lo(sizes.size()), len(sizes.size());
      bool meets = true;
      for (size_t d = 0; meets && d < sizes.size(); ++d) {
        lo[d] = std::max(offsets[d], c.offsets[d]);
        len[d] = std::min(offsets[d] + sizes[d], c.offsets[d] + c.sizes[d]) - lo[d];
        meets = len[d] > 0;
      }
      if (!meets || c10::multiply_integers(len) == 0) continue;
      torch::Tensor from = r_.chunk(e, c, name), to = into;
      for (size_t d = 0; d < sizes.size(); ++d) {
        const auto dim = static_cast<int64_t>(d);
        from = from.narrow(dim, lo[d] - c.offsets[d], len[d]);
        to = to.narrow(dim, lo[d] - offsets[d], len[d]);
      }
      to.copy_(from);
      safetensors::release_pages(r_.chunk(e, c, name));
      covered += c10::multiply_integers(len);
    }
    if (covered != into.numel())
      throw DamagedCheckpoint(where() + ": the chunks of '" + name + "' hold " + std::to_string(covered) + " of the " +
                              std::to_string(into.numel()) + " elements asked for");
  }

 private:
  const ckpt::TensorEntry& entry(const std::string& name) const {
    auto it = t_.find(name);
    if (it == t_.end()) throw std::runtime_error(where() + " has no tensor '" + name + "'");
    return it->second;
  }
  const CheckpointReader& r_;
  std::string ref_;
  const std::map<std::string, ckpt::TensorEntry>& t_;
};

std::unique_ptr<StateSource> CheckpointReader::state(const std::string& ref) const {
  if (!m_.tensors.count(ref)) throw std::runtime_error("checkpoint " + folder_ + " has no state '" + ref + "'");
  return std::make_unique<CheckpointStateSource>(*this, ref);
}

}  // namespace flowrun
