// A minimal good plugin for the registry tests: node type `t_plugin_scale` (out = in * k).
#include <stdexcept>

#include "plugin_api.hpp"

namespace {
class Scale : public flowrun::Node {
  int64_t k_ = 1;

 public:
  void setup(flowrun::SetupContext& c) override { k_ = c.params().get<int64_t>("k"); }
  void run(flowrun::StepContext& c) override { c.out("out", c.in<int64_t>("in") * k_); }
};
}  // namespace

// `t_plugin_fail`: throws at step `at`, for the CLI's failure exit code test.
namespace {
class Fail : public flowrun::Node {
  int64_t at_ = 0;

 public:
  void setup(flowrun::SetupContext& c) override { at_ = c.params().get<int64_t>("at"); }
  void run(flowrun::StepContext& c) override {
    if (c.step() == at_) throw std::runtime_error("deliberate failure");
  }
};
}  // namespace

FLOWRUN_PLUGIN(reg) {
  reg.add(R"(type: t_plugin_scale
doc: "test plugin: out = in * k"
inputs: { in: { kind: value, type: int, doc: "a number" } }
outputs: { out: { kind: value, type: int, doc: "in * k" } }
params: { k: { type: int, default: 2, doc: "factor" } })",
          [] { return std::make_unique<Scale>(); }, FLOWRUN_PLUGIN_FILE);
  reg.add(R"(type: t_plugin_fail
doc: "test plugin: throws at step `at`"
params: { at: { type: int, default: 3, doc: "the step that fails" } })",
          [] { return std::make_unique<Fail>(); }, FLOWRUN_PLUGIN_FILE);
}
