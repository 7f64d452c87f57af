// ParamUse's thread-local registry (param_use.hpp).
#include "models/param_use.hpp"

namespace flowrun {

namespace {
thread_local ParamUse* t_current = nullptr;
}

ParamUse::ParamUse() : previous_(t_current) { t_current = this; }
ParamUse::~ParamUse() { t_current = previous_; }
ParamUse* ParamUse::current() { return t_current; }

}  // namespace flowrun
