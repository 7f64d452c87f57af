// Pipeline stages' view of a model (stages.hpp).
#include "models/stages.hpp"

#include <algorithm>

namespace flowrun {

bool Stages::holds(int chunk) const { return std::find(mine.begin(), mine.end(), chunk) != mine.end(); }

namespace {
thread_local const StageCall* g_call = nullptr;
}

StageCall::StageCall(int c, const TensorMap& i) : chunk(c), in(i), previous_(g_call) { g_call = this; }
StageCall::~StageCall() { g_call = previous_; }
const StageCall* StageCall::current() { return g_call; }

}  // namespace flowrun
