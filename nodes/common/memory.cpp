#include "common/memory.hpp"

#include <spdlog/fmt/fmt.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace flowrun {

namespace {

// The first number in a file ("max" and missing files: 0).
uint64_t read_number(const std::string& path) {
  std::ifstream in(path);
  uint64_t v = 0;
  if (in >> v) return v;
  return 0;
}

}  // namespace

std::string bytes_text(double b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB", "PB"};
  int u = 0;
  while (b >= 1000 && u < 5) b /= 1000, ++u;
  return fmt::format("{:.1f} {}", b, units[u]);
}

uint64_t available_host_memory() {
  uint64_t avail = 0;
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);)
    if (line.rfind("MemAvailable:", 0) == 0) {
      std::istringstream(line.substr(13)) >> avail;
      avail *= 1024;  // kB
    }
  // cgroup v2, then v1: a limit below the machine's memory is the one that counts.
  uint64_t limit = read_number("/sys/fs/cgroup/memory.max"), used = read_number("/sys/fs/cgroup/memory.current");
  if (!limit) {
    limit = read_number("/sys/fs/cgroup/memory/memory.limit_in_bytes");
    used = read_number("/sys/fs/cgroup/memory/memory.usage_in_bytes");
  }
  if (limit && limit < (uint64_t{1} << 60)) {
    const uint64_t left = limit > used ? limit - used : 0;
    if (!avail || left < avail) avail = left;
  }
  return avail;
}

void check_model_fits(const std::string& who, const std::string& config, double params, bool frozen, int64_t layers) {
  if (layers > kMaxLayers)
    throw std::runtime_error(fmt::format("{} ({}): {} layers, more than the {} flowrun builds (the deepest published "
                                         "models have a few hundred); is the number right?",
                                         who, config, layers, kMaxLayers));
  const uint64_t avail = available_host_memory();
  if (!avail) return;
  const double need = params * (frozen ? kWeightBytes : kWeightBytes + kGradBytes);
  const std::string what = fmt::format("{} ({}) has about {:.3g} parameters", who, config, params);
  if (need > static_cast<double>(avail))
    throw std::runtime_error(fmt::format(
        "{}: {} in fp32{} but this machine has {} available; make the model smaller", what, bytes_text(need),
        frozen ? " weights," : " weights and gradients,", bytes_text(static_cast<double>(avail))));
  const double adamw = params * (kWeightBytes + kGradBytes + kAdamwStateBytes);
  if (!frozen && adamw > static_cast<double>(avail))
    spdlog::warn("{}: training it with AdamW takes about {} (weights, gradients, two moments), more than the {} "
                 "available", what, bytes_text(adamw), bytes_text(static_cast<double>(avail)));
}

void check_batch_fits(const std::string& who, const std::string& what, double bytes) {
  const uint64_t avail = available_host_memory();
  if (avail && bytes > static_cast<double>(avail))
    throw std::runtime_error(fmt::format("{}: a batch ({}) is {}, but this machine has {} available; make the batch or "
                                         "the size smaller",
                                         who, what, bytes_text(bytes), bytes_text(static_cast<double>(avail))));
}

double TrainingMemory::total() const {
  double t = weights + gradients + std::max(activations, 0.0);
  for (const auto& k : kept) t += k.bytes;
  return t;
}

double TrainingMemory::to_allocate() const {
  double t = gradients + std::max(activations, 0.0);
  for (const auto& k : kept)
    if (!k.allocated) t += k.bytes;
  return t;
}

std::string TrainingMemory::text() const {
  std::string s = "weights " + bytes_text(weights) + ", gradients " + bytes_text(gradients);
  if (!gradients_note.empty()) s += " (" + gradients_note + ")";
  for (const auto& k : kept) s += ", " + k.what + " (" + k.node + ") " + bytes_text(k.bytes);
  s += activations >= 0 ? ", activations of a micro-batch (" + activations_note + ") " + bytes_text(activations)
                        : ", activations (not estimated for this model)";
  return s + " = " + bytes_text(total());
}

}  // namespace flowrun
