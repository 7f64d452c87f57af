// mlp: a multi-layer perceptron model node (owns its parameters; no per-step work). The
// module: models/mlp.hpp. Schema: schemas/mlp.yaml. Test: tests/nodes/mlp_test.cpp.
#include <spdlog/fmt/fmt.h>

#include "models/mlp.hpp"
#include "models/model_node.hpp"
#include "registry.hpp"

namespace flowrun {
namespace {

class MlpNode : public ModelNode {
  mlp::Config c_;

  Plan configure(SetupContext& ctx) override {
    const Params& p = ctx.params();
    p.read<int64_t>({{"in_dim", &c_.in_dim}, {"hidden", &c_.hidden}, {"layers", &c_.layers}, {"out_dim", &c_.out_dim}});
    c_.activation = p.get<std::string>("activation");
    return {fmt::format("{} layers of {}, {} in, {} out", c_.layers, c_.hidden, c_.in_dim, c_.out_dim),
            mlp::parameter_count(c_), c_.layers};
  }

  // Initialised on the CPU (seeded, device-independent), then placed. The schema has no
  // `weights`: the MLP always starts from its init.
  std::shared_ptr<ModelState> build(uint64_t seed, bool, std::string& how) override {
    how = "init, seed " + std::to_string(seed);
    return mlp::make(c_, seed);
  }

  void load_weights(ModelState&, const std::string&) override {
    throw std::logic_error("mlp: no weights parameter (schemas/mlp.yaml)");
  }
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(mlp, flowrun::MlpNode)
