// `t_fault`: a node that fails on purpose on one rank at one step, for the multi-process fault
// tests (tests/mpi/mpi_test.sh). Loaded with `plugins:`, so the real flowrun binary runs it.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>

#include "plugin_api.hpp"

namespace {
class Fault : public flowrun::Node {
  int64_t rank_ = 1, step_ = 5;
  std::string mode_, marker_;
  int64_t delay_ms_ = 0;

 public:
  void setup(flowrun::SetupContext& c) override {
    rank_ = c.params().get<int64_t>("rank");
    step_ = c.params().get<int64_t>("step");
    mode_ = c.params().get<std::string>("mode");
    marker_ = c.params().get<std::string>("marker");
    delay_ms_ = c.params().get<int64_t>("delay_ms");
  }
  void run(flowrun::StepContext& c) override {
    if (c.run().rank != rank_ || c.step() != step_) return;
    if (!marker_.empty()) {  // once: a restarted job runs on
      if (::access(marker_.c_str(), F_OK) == 0) return;
      if (FILE* f = std::fopen(marker_.c_str(), "w")) std::fclose(f);
    }
    if (mode_ == "mark") {  // only the marker: a test outside injects the fault (a link down) now
      if (delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
      return;
    }
    if (mode_ == "throw") throw std::runtime_error("deliberate failure on rank " + std::to_string(rank_));
    if (mode_ == "kill") ::kill(::getpid(), SIGKILL);
    if (mode_ == "stop") ::kill(::getpid(), SIGSTOP);  // every thread silent: as a dead host or a cut link
    if (mode_ == "hang")
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
};
}  // namespace

FLOWRUN_PLUGIN(reg) {
  reg.add(R"(type: t_fault
doc: "test plugin: fails on rank `rank` at step `step`: throw, kill (SIGKILL itself), hang (this node), stop: SIGSTOP itself, every thread; or mark: make the marker file for a test to act on"
inputs: { after: { kind: value, type: any, optional: true, doc: "run after this value of the step" } }
params:
  rank: { type: int, default: 1, doc: "the rank that fails" }
  step: { type: int, default: 5, doc: "the step it fails at" }
  mode: { type: enum, values: [throw, kill, hang, stop, mark], default: throw, doc: "how it fails; mark: it only makes the marker file, then waits delay_ms, while a test injects a fault" }
  delay_ms: { type: int, default: 0, doc: "mark: how long it waits after making the marker" }
  marker: { type: string, default: "", doc: "if set: fail only when this file does not exist, and make it: once, a restarted job runs on" })",
          [] { return std::make_unique<Fault>(); }, FLOWRUN_PLUGIN_FILE);
}
