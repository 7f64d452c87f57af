// `t_fault`: a node that fails on purpose on one rank at one step, for the multi-process fault
// tests (tests/mpi/mpi_test.sh). Loaded with `plugins:`, so the real flowrun binary runs it.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

#include "plugin_api.hpp"

namespace {
class Fault : public flowrun::Node {
  int64_t rank_ = 1, step_ = 5;
  std::string mode_;

 public:
  void setup(flowrun::SetupContext& c) override {
    rank_ = c.params().get<int64_t>("rank");
    step_ = c.params().get<int64_t>("step");
    mode_ = c.params().get<std::string>("mode");
  }
  void run(flowrun::StepContext& c) override {
    if (c.run().rank != rank_ || c.step() != step_) return;
    if (mode_ == "throw") throw std::runtime_error("deliberate failure on rank " + std::to_string(rank_));
    if (mode_ == "kill") ::kill(::getpid(), SIGKILL);
    if (mode_ == "hang")
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
};
}  // namespace

FLOWRUN_PLUGIN(reg) {
  reg.add(R"(type: t_fault
doc: "test plugin: fails on rank `rank` at step `step`: throw, kill (SIGKILL itself) or hang"
inputs: { after: { kind: value, type: any, optional: true, doc: "run after this value of the step" } }
params:
  rank: { type: int, default: 1, doc: "the rank that fails" }
  step: { type: int, default: 5, doc: "the step it fails at" }
  mode: { type: enum, values: [throw, kill, hang], default: throw, doc: "how it fails" })",
          [] { return std::make_unique<Fault>(); }, FLOWRUN_PLUGIN_FILE);
}
