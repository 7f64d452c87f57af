// Internal to the optimizer (optimizer.cpp, optimizer_slots.cpp): making and filling a state's
// slots. Nodes use train/optimizer.hpp.
#pragma once
#include <map>
#include <string>

#include "train/optimizer.hpp"

namespace flowrun {

// Leaving the on-device path (or loading a state): each slot's host step from the device's.
void settle_fused_step(OptimizerState& st);
// The slots for these parameters, their moments zeroed in flat buffers (see OptimizerState).
void make_slots(OptimizerState& st, const ModelState::Named& params, const OptimConfig& cfg);
// The saved moments of a slot: copied into its moments where they exist, else copies on `device`.
void load_slot(OptimizerState::Slot& s, const std::map<std::string, torch::Tensor>& t, const c10::Device& device);

}  // namespace flowrun
