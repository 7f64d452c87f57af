// mlp: a multi-layer perceptron model node (owns its parameters; no per-step work). The
// module: models/mlp.hpp. Schema: schemas/mlp.yaml. Test: tests/nodes/mlp_test.cpp.
#include <spdlog/fmt/fmt.h>

#include "common/memory.hpp"
#include "models/mlp.hpp"
#include "models/model_node.hpp"
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
    const std::string what = fmt::format("{} layers of {}, {} in, {} out", c.layers, c.hidden, c.in_dim, c.out_dim);
    check_model_fits(ctx.who(), what, mlp::parameter_count(c));
    const uint64_t seed = node_seed(ctx);
    // Initialised on the CPU (seeded, device-independent), then placed.
    own_model(ctx, mlp::make(c, seed), what, "init, seed " + std::to_string(seed));
  }

  void run(StepContext&) override {}  // parameters change only through the optimizer
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(mlp, flowrun::MlpNode)
