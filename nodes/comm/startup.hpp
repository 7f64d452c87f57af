// Start-up consistency of a multi-process run (torch-free interface: the run session, session/, includes it).
#pragma once

namespace flowrun {

class Executor;
struct GraphSpec;
namespace comm {
class Channel;
}

// After every node's setup() (and a resume's restore()): make every rank's state equal to rank
// 0's. Every state object with a StateIO (common/state_io.hpp: model parameters and buffers,
// optimizer moments, EMA weights, data cursors), in file order, is first checked to have the
// same tensor names, shapes and dtypes on every rank (a clear error naming the state and the
// ranks if not), then broadcast from rank 0, the way DDP broadcasts parameters and buffers when
// it wraps a model. A single-process run only builds the (cheap) descriptors and copies
// nothing: the state is left exactly as it was. Implementation: comm/startup.cpp.
void sync_start_state(Executor& ex, const GraphSpec& g, comm::Channel& ch);

}  // namespace flowrun
