#include "common/torch_setup.hpp"

#include <torch/torch.h>

#include <thread>

namespace flowrun {

void configure_torch(int threads, uint64_t seed) {
  int n = threads > 0 ? threads : static_cast<int>(std::thread::hardware_concurrency());
  at::set_num_threads(std::max(1, n));
  torch::manual_seed(seed);
}

}  // namespace flowrun
