// mse_loss: mean squared error between the model's output and the batch's y.
// Schema: schemas/mse_loss.yaml. Test: tests/nodes/objectives_test.cpp.
#include "common/batch_keys.hpp"
#include "train/losses.hpp"

namespace flowrun {

torch::Tensor MseLoss::loss(ModelState& model, const TensorMap& batch) const {
  const torch::Tensor& y = batch.at(batch_key::targets);
  torch::Tensor pred = model.forward(batch);
  if (!pred.sizes().equals(y.sizes()))
    throw std::runtime_error("objective " + type + ": model output " + shape_str(pred) +
                             " and target y " + shape_str(y) + " differ in shape");
  return torch::mse_loss(pred, y.to(pred.dtype()));
}

int64_t MseLoss::targets(const TensorMap& batch) const { return batch.at(batch_key::targets).size(0); }

}  // namespace flowrun

FLOWRUN_OBJECTIVE(mse_loss, flowrun::MseLoss)
