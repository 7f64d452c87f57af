// concat_batches: several batches (and their captions) as one, rows in the order listed.
// Schema: schemas/concat_batches.yaml. Test: tests/nodes/concat_batches_test.cpp.
#include "common/tensor_map.hpp"
#include "node.hpp"
#include "registry.hpp"

namespace flowrun {
namespace {

class ConcatBatches : public Node {
 public:
  void run(StepContext& c) override {
    const std::vector<const Value*> batches = c.in_all("batches");
    const std::vector<std::string> refs = c.refs("batches");
    std::vector<const TensorMap*> maps;
    for (size_t i = 0; i < batches.size(); ++i) maps.push_back(&batches[i]->as<TensorMap>(c.who() + " input " + refs[i]));
    TensorMap out;
    std::vector<int64_t> rows(maps.size(), -1);
    for (const auto& [key, first] : *maps[0]) {
      std::vector<torch::Tensor> parts;
      for (size_t i = 0; i < maps.size(); ++i) {
        auto it = maps[i]->find(key);
        if (it == maps[i]->end() || maps[i]->size() != maps[0]->size())
          throw std::runtime_error(c.who() + ": the batches have other keys: " + refs[0] + " has " + keys_of(*maps[0]) +
                                   ", " + refs[i] + " has " + keys_of(*maps[i]) + "; concatenate batches of one kind");
        const torch::Tensor& t = it->second;
        if (t.dim() == 0 || t.sizes().slice(1) != first.sizes().slice(1) || t.scalar_type() != first.scalar_type() ||
            t.device() != first.device())
          throw std::runtime_error(c.who() + ": key '" + key + "' is " + shape_str(first) + " " +
                                   c10::toString(first.scalar_type()) + " in " + refs[0] + " but " + shape_str(t) + " " +
                                   c10::toString(t.scalar_type()) + " in " + refs[i] +
                                   " (on " + t.device().str() + "): every dimension but the first must agree (images: "
                                   "the same size)");
        if (rows[i] < 0) rows[i] = t.size(0);
        if (t.size(0) != rows[i])
          throw std::runtime_error(c.who() + ": " + refs[i] + "'s tensors have different row counts (" + key + ": " +
                                   std::to_string(t.size(0)) + ", another key: " + std::to_string(rows[i]) + ")");
        parts.push_back(t);
      }
      out[key] = torch::cat(parts, 0);
    }
    c.out("batch", std::move(out));
    std::vector<std::string> captions;
    if (c.connected("captions")) {
      const std::vector<const Value*> texts = c.in_all("captions");
      const std::vector<std::string> text_refs = c.refs("captions");
      if (texts.size() != maps.size())
        throw std::runtime_error(c.who() + ": " + std::to_string(maps.size()) + " batches but " +
                                 std::to_string(texts.size()) + " caption lists; give one per batch, in the same order");
      for (size_t i = 0; i < texts.size(); ++i) {
        const auto& list = texts[i]->as<std::vector<std::string>>(c.who() + " input " + text_refs[i]);
        if (rows[i] >= 0 && static_cast<int64_t>(list.size()) != rows[i])
          throw std::runtime_error(c.who() + ": " + text_refs[i] + " has " + std::to_string(list.size()) +
                                   " captions for the " + std::to_string(rows[i]) + " rows of " + refs[i]);
        captions.insert(captions.end(), list.begin(), list.end());
      }
    }
    c.out("captions", std::move(captions));
  }
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(concat_batches, flowrun::ConcatBatches)
