// Device streams: the queues a GPU runs work from, and the events that order them. The
// executor talks to a device only through this interface (torch-free, CUDA-free):
//
//   - each stream name of a graph (`stream: ema`, free names; none = "default") is one stream;
//   - a node's run() (and on_item()) is bracketed by begin()/end(): the node's stream is the
//     current one on that thread, so every kernel the node launches is enqueued on it and
//     run() returns as soon as the work is queued, not done;
//   - when run() returns the executor record()s an event on the node's stream; a consumer on
//     another stream wait()s for it on the device (cudaStreamWaitEvent), never on the host;
//   - a node that reads results on the host (metrics reading a loss) calls
//     StepContext::sync(port), which synchronizes that producer's event, and only then.
//
// Implementations: CUDA streams and events (nodes/common/cuda_streams.cpp, FLOWRUN_CUDA
// builds), and a CPU test double where each stream is a worker thread running what was
// enqueued on it (tests/support/thread_streams.hpp), so the ordering is tested without a GPU.
// Without a device (RunOptions::streams == nullptr) nodes run synchronously on the host and
// none of this is called.
#pragma once
#include <memory>
#include <string>

namespace flowrun {

class Value;

// Something recorded on a stream: done once the stream's work queued before it is done.
class DeviceEvent {
 public:
  virtual ~DeviceEvent() = default;
  // Block the calling (host) thread until the event has happened.
  virtual void synchronize() const = 0;
};

class DeviceStreams {
 public:
  virtual ~DeviceStreams() = default;
  // The id of the stream named `name` ("" or "default": the device's default stream). The
  // same name gives the same id; called while the executor is built, before any step.
  virtual int stream(const std::string& name) = 0;
  // Make `stream` the calling thread's current stream until end(); `label` ("fb step 12")
  // names the range in profilers (NVTX on CUDA). begin/end pair on one thread, not nested.
  virtual void begin(int stream, const std::string& label) = 0;
  virtual void end(int stream) = 0;
  // An event after everything enqueued on `stream` so far.
  virtual std::shared_ptr<DeviceEvent> record(int stream) = 0;
  // Work enqueued on `stream` from now on starts after `event` (a device-side wait).
  virtual void wait(int stream, const DeviceEvent& event) = 0;
  // `v` (a value made on another stream) is used on `stream`: keep its memory from being
  // reused until the work queued there so far is done (CUDA: Tensor::record_stream).
  virtual void used_on(const Value& v, int stream) = 0;
  // Block the host until every stream is idle (end of run, before nodes' finish()).
  virtual void synchronize_all() = 0;
};

}  // namespace flowrun
