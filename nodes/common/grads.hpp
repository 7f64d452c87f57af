// Grads: what travels on a `grads` port. One tensor per trainable parameter of the model,
// in the order of ModelState::trainable_parameters() (module registration order). They are
// the parameters' .grad() tensors themselves (aliases, not copies); an entry is undefined
// (!t.defined()) when that parameter received no gradient this step, and the optimizer
// skips it (like PyTorch skips params whose .grad is None).
#pragma once
#include <torch/torch.h>

#include <vector>

namespace flowrun {

using Grads = std::vector<torch::Tensor>;

}  // namespace flowrun
