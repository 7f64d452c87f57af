// A CPU test double of the executor's device streams (engine/device_streams.hpp): each stream
// is a worker thread that runs, in order, what was enqueued on it, as a GPU runs a CUDA
// stream's kernels. A node's run() enqueues its "kernels" (lambdas, with sleeps to stand in
// for long kernels) on the current stream and returns at once, like a CUDA node, so the
// ordering the executor promises (a consumer on another stream never sees an unfinished
// producer's output, state order across streams, host syncs only where asked) is tested on
// machines without a GPU. Counts what the executor asked for: waits, host syncs.
//
//   ThreadStreams s;  RunOptions o;  o.streams = &s;  ... run ...
//   ThreadStreams::enqueue_current([&]{ ... });   // from a node's run(), on its stream
#pragma once
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "device_streams.hpp"

namespace flowrun::test {

class ThreadStreams : public DeviceStreams {
 public:
  ThreadStreams();
  ~ThreadStreams() override;

  int stream(const std::string& name) override;
  void begin(int stream, const std::string& label) override;
  void end(int stream) override;
  std::shared_ptr<DeviceEvent> record(int stream) override;
  void wait(int stream, const DeviceEvent& event) override;
  void used_on(const Value& v, int stream) override;
  void synchronize_all() override;

  // Queue `work` on the calling thread's current stream (set by begin(); the executor does
  // that around a node's run()). Throws when no stream is current.
  static void enqueue_current(std::function<void()> work);
  // The instance whose begin() is current on this thread (for test nodes).
  static ThreadStreams* current();

  // What the executor asked for, since construction.
  int waits() const { return waits_.load(); }          // device-side waits enqueued
  int host_syncs() const { return host_syncs_.load(); }  // DeviceEvent::synchronize calls
  int used_on_calls() const { return used_on_.load(); }

 private:
  struct Stream {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::function<void()>> q;
    bool stop = false;
    std::thread worker;
  };
  class Event;
  void enqueue(int stream, std::function<void()> work);
  Stream& at(int stream) const;

  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Stream>> streams_;
  std::map<std::string, int> ids_;
  std::atomic<int> waits_{0}, host_syncs_{0}, used_on_{0};
};

}  // namespace flowrun::test
