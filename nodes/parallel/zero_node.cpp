// zero: the ZeRO plan (parallel/zero_plan.hpp), a state the nodes it concerns read.
// Schema: schemas/zero.yaml. Tests: tests/nodes/graph_gpt_test.cpp (ZeRO.*), tests/mpi.
#include <memory>

#include "parallel/zero_plan.hpp"
#include "registry.hpp"

namespace flowrun {
namespace {

class ZeroNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    auto plan = std::make_shared<ZeroPlan>();
    plan->stage = ZeroPlan::parse(ctx.params().get<std::string>("stage"));
    plan->whole_tensors = ctx.params().get<std::string>("cut") == "tensors";
    ctx.own_state("plan", plan);
  }
  void run(StepContext&) override {}
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(zero, flowrun::ZeroNode)
