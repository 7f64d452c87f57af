// Model sizes checked before anything is allocated: a config that cannot fit is an error with
// the figures, not a bad_alloc after a minute (or the machine's memory taken). Torch-free.
#pragma once
#include <cstdint>
#include <string>

namespace flowrun {

// Bytes this process may still allocate on the host: MemAvailable (/proc/meminfo), lowered
// to the cgroup's memory limit minus its usage where there is one (containers, Slurm jobs).
// 0 when unknown.
uint64_t available_host_memory();

// A model of `params` parameters, about to be built on the host. Refuses (std::runtime_error
// naming `who`, the config in `config` and the figures) when its fp32 weights and gradients
// alone exceed available_host_memory(); warns when training with AdamW (weights, gradients,
// two moments: 16 bytes a parameter) would. `frozen`: weights only (4 bytes a parameter).
void check_model_fits(const std::string& who, const std::string& config, double params, bool frozen = false);

}  // namespace flowrun
