// DataCursor's registration with checkpoint/resume (common/state_io.hpp), beside its definition.
#include "data/cursor.hpp"

#include "common/state_io.hpp"

FLOWRUN_STATE_TYPE(flowrun::DataCursor)
