// ModelState's registration with checkpoint/resume (common/state_io.hpp), beside its definition.
#include "models/model_state.hpp"

#include "common/state_io.hpp"

FLOWRUN_STATE_TYPE(flowrun::ModelState)
