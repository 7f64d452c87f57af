// mlp: a multi-layer perceptron model node (owns its parameters; no per-step work). The
// module: models/mlp.hpp. Schema: schemas/mlp.yaml. Test: tests/nodes/mlp_test.cpp.
#include <spdlog/fmt/fmt.h>

#include "common/device.hpp"
#include "common/memory.hpp"
#include "models/mlp.hpp"
#include "registry.hpp"

namespace flowrun {
namespace {

class MlpNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const Params& p = ctx.params();
    mlp::Config c;
    p.read<int64_t>({{"in_dim", &c.in_dim}, {"hidden", &c.hidden}, {"layers", &c.layers}, {"out_dim", &c.out_dim}});
    c.activation = p.get<std::string>("activation");
    check_model_fits(ctx.who(), fmt::format("{} layers of {}, {} in, {} out", c.layers, c.hidden, c.in_dim, c.out_dim),
                     mlp::parameter_count(c));
    std::shared_ptr<ModelState> state = mlp::make(c, node_seed(ctx));
    state->module->to(run_device(ctx.run()));  // initialised on the CPU (seeded, device-independent), then placed
    ctx.own_state("params", state);
  }

  void run(StepContext&) override {}  // parameters change only through the optimizer
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(mlp, flowrun::MlpNode)
