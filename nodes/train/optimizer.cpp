// optimizer: AdamW, SGD with momentum or Adafactor, decoupled weight decay, grad-norm clipping and
// a learning-rate schedule. Schema: schemas/optimizer.yaml. Test: tests/nodes/optimizer_test.cpp.
#include "train/optimizer.hpp"

#include <spdlog/spdlog.h>

#include <ATen/Parallel.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>

#include "common/cpu_simd.hpp"
#include "common/device.hpp"
#include "common/state_io.hpp"
#include "registry.hpp"

namespace flowrun {

OptimKind optim_kind(const std::string& name) {
  if (name == "adamw") return OptimKind::adamw;
  if (name == "sgd") return OptimKind::sgd;
  if (name == "adafactor") return OptimKind::adafactor;
  throw std::invalid_argument("unknown optimizer kind '" + name + "' (adamw, sgd or adafactor)");
}

LrDecay lr_decay(const std::string& name) {
  if (name == "constant") return LrDecay::constant;
  if (name == "cosine") return LrDecay::cosine;
  if (name == "linear") return LrDecay::linear;
  throw std::invalid_argument("unknown lr schedule '" + name + "' (constant, cosine or linear)");
}

double LrSchedule::at(int64_t step, int64_t last_step) const {
  if (warmup > 0 && step <= warmup) return lr * static_cast<double>(step) / static_cast<double>(warmup);
  if (kind == LrDecay::constant || last_step <= warmup) return lr;
  double progress = static_cast<double>(step - warmup) / static_cast<double>(last_step - warmup);
  progress = std::min(1.0, std::max(0.0, progress));
  if (kind == LrDecay::cosine) return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
  return lr - (lr - min_lr) * progress;  // linear
}

std::pair<int64_t, int64_t> adafactor_factored_dims(c10::IntArrayRef shape, int64_t min_dim_size_to_factor) {
  if (shape.size() < 2) return {-1, -1};
  std::vector<int64_t> order(shape.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return shape[x] < shape[y]; });
  const int64_t a = order[order.size() - 1], b = order[order.size() - 2];
  if (shape[b] < min_dim_size_to_factor) return {-1, -1};
  return {a, b};
}

namespace {

// Adafactor's direction for one parameter (optimizer.hpp, OptimConfig::adafactor), its slot's
// moments updated in place; s.step is this update's t (1-based).
torch::Tensor adafactor_direction(OptimizerState::Slot& s, const torch::Tensor& g0, const AdafactorConfig& c) {
  const torch::Tensor g = g0.to(torch::kFloat);
  const double beta2 = std::min(c.beta2_cap, 1.0 - std::pow(static_cast<double>(s.step), -c.decay_rate));
  const torch::Tensor r = g.square().add_(c.eps);
  torch::Tensor u;
  if (s.v_row.defined()) {
    const auto [a, b] = adafactor_factored_dims(g.sizes(), 0);  // the slot was made factored: same dims
    s.v_row.mul_(beta2).add_(r.mean(a), 1.0 - beta2);
    s.v_col.mul_(beta2).add_(r.mean(b), 1.0 - beta2);
    const int64_t b_in_row = b > a ? b - 1 : b;  // dim b of p within v_row (dim a removed)
    const torch::Tensor row = (s.v_row / s.v_row.mean(b_in_row, /*keepdim=*/true)).rsqrt();
    u = g * row.unsqueeze(a) * s.v_col.rsqrt().unsqueeze(b);
  } else {
    s.v.mul_(beta2).add_(r, 1.0 - beta2);
    u = g * s.v.rsqrt();
  }
  if (c.clipping_threshold > 0) {  // clip_by_block_rms
    const torch::Tensor rms = u.square().mean().sqrt();
    u = u / torch::clamp_min(rms / c.clipping_threshold, 1.0);
  }
  if (c.momentum > 0) {
    s.exp_avg.mul_(c.momentum).add_(u, 1.0 - c.momentum);
    u = s.exp_avg;
  }
  return u.to(g0.dtype());
}

}  // namespace

std::map<std::string, torch::Tensor> OptimizerState::tensors() const {
  std::map<std::string, torch::Tensor> out;
  // The fused path's step lives on the device (a read here, where a checkpoint copies anyway).
  const int64_t fused = fused_step.defined() ? static_cast<int64_t>(fused_step.item<double>()) : -1;
  for (const Slot& s : slots) {
    if (s.exp_avg.defined()) out[s.name + ".exp_avg"] = s.exp_avg;
    if (s.exp_avg_sq.defined()) out[s.name + ".exp_avg_sq"] = s.exp_avg_sq;
    if (s.momentum.defined()) out[s.name + ".momentum_buffer"] = s.momentum;
    if (s.v_row.defined()) out[s.name + ".v_row"] = s.v_row;
    if (s.v_col.defined()) out[s.name + ".v_col"] = s.v_col;
    if (s.v.defined()) out[s.name + ".v"] = s.v;
    out[s.name + ".step"] = torch::tensor(fused >= 0 ? fused : s.step, torch::kInt64);
  }
  out["updates"] = torch::tensor(updates, torch::kInt64);
  return out;
}

namespace {

// AdamW on a GPU with libtorch >= 2: the update below, as torch's fused multi-tensor kernel
// (torch.optim.AdamW(fused=True)): one launch for all parameters of a group instead of ~8 per
// parameter. Same math (decoupled decay, bias corrections, eps outside the sqrt); the clip
// factor enters as the kernel's grad_scale (it divides: 1 / coef), a non-finite step's flag
// as its found_inf (the kernel then changes nothing, and the step tensor does not advance).
// Two groups: parameters that decay and those that do not (decays()).
//
// fused_adamw_applies says whether it applies: not for CPU tensors, an older libtorch, mixed
// devices or dtypes, a parameter without a gradient this step, or moments of different ages
// (a parameter that once had no gradient); the loop below then runs.
bool fused_adamw_applies(const OptimizerState& st, const ModelState::Named& params, const Grads& grads) {
#if TORCH_VERSION_MAJOR >= 2
  if (params.empty() || !params.front().second.is_cuda()) return false;
  const torch::Device device = params.front().second.device();
  const auto dtype = params.front().second.scalar_type();
  for (size_t i = 0; i < params.size(); ++i)
    if (!grads[i].defined() || params[i].second.device() != device || params[i].second.scalar_type() != dtype ||
        grads[i].scalar_type() != dtype)
      return false;
  // All parameters take this step together, so one step tensor serves every one of them.
  for (const auto& s : st.slots)
    if (s.step != st.slots.front().step) return false;
  return true;
#else
  (void)st, (void)params, (void)grads;
  return false;
#endif
}

void fused_adamw(OptimizerState& st, const ModelState::Named& params, const Grads& grads, const OptimConfig& cfg,
                 double lr, const torch::Tensor& coef, const torch::Tensor& found_inf) {
#if TORCH_VERSION_MAJOR >= 2
  const torch::Device device = params.front().second.device();
  if (!st.fused_step.defined())
    st.fused_step = torch::full({}, static_cast<double>(st.slots.front().step),
                                torch::TensorOptions().dtype(torch::kFloat).device(device));
  // step += 1 - found: a skipped update does not count (torch's fused AdamW does the same).
  if (found_inf.defined())
    st.fused_step.sub_(found_inf).add_(1);
  else
    st.fused_step.add_(1);
  std::vector<at::Tensor> p[2], g[2], m[2], v[2], steps[2];
  for (size_t i = 0; i < params.size(); ++i) {
    OptimizerState::Slot& s = st.slots[i];
    torch::Tensor w = params[i].second;
    if (!s.exp_avg.defined()) s.exp_avg = torch::zeros_like(w, at::MemoryFormat::Preserve);
    if (!s.exp_avg_sq.defined()) s.exp_avg_sq = torch::zeros_like(w, at::MemoryFormat::Preserve);
    s.step += 1;  // the host's count; fused_step is the truth (tensors() reports it)
    const int k = decays(w) ? 0 : 1;
    p[k].push_back(w);
    g[k].push_back(grads[i]);
    m[k].push_back(s.exp_avg);
    v[k].push_back(s.exp_avg_sq);
  }
  c10::optional<at::Tensor> scale, found;
  if (coef.defined()) scale = coef.reciprocal().to(torch::kFloat);
  if (found_inf.defined()) found = found_inf;
  for (int k = 0; k < 2; ++k) {
    if (p[k].empty()) continue;
    steps[k].assign(p[k].size(), st.fused_step);
    at::_fused_adamw_(p[k], g[k], m[k], v[k], /*max_exp_avg_sqs=*/{}, steps[k], lr, cfg.beta1, cfg.beta2,
                      k == 0 ? cfg.weight_decay : 0.0, cfg.eps, /*amsgrad=*/false, /*maximize=*/false, scale, found);
  }
#else
  (void)st, (void)params, (void)grads, (void)cfg, (void)lr, (void)coef, (void)found_inf;
  throw std::logic_error("fused_adamw: this libtorch has no fused AdamW (check fused_adamw_applies first)");
#endif
}

// Leaving the fused path (or loading a state): each slot's host step from the device's.
void settle_fused_step(OptimizerState& st) {
  if (!st.fused_step.defined()) return;
  const auto step = static_cast<int64_t>(st.fused_step.item<double>());
  for (auto& s : st.slots) s.step = step;
  st.fused_step = torch::Tensor();
}

// AdamW and SGD on the CPU for fp32 parameters: every update is one pass over its tensors,
// 8 floats at a time, instead of the ~10 passes of tensor operations (each reading and writing
// whole tensors) that the generic update below takes. Same formulas, same order per element:
//   AdamW: g' = g * clip;  m = b1 m + (1 - b1) g';  v = b2 v + (1 - b2) g'^2
//          p  = p (1 - lr wd)  -  (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps)
//   SGD:   g' = g * clip;  m = mu m + g' (momentum; m starts at 0, so m = g' the first time)
//          p  = p (1 - lr wd)  -  lr m        (or - lr g' without momentum)
// (decay = 1 - lr wd only where decays(p), else 1; bc1, bc2 = 1 - b^t for the slot's step t).
struct AdamwStep {
  float clip, b1, b2, decay, step_size, sqrt_bc2, eps;
};
struct SgdStep {
  float clip, decay, lr, momentum;
};

#if FLOWRUN_HAVE_AVX2_CODE
FLOWRUN_AVX2 void adamw_cpu_kernel(float* p, const float* g, float* m, float* v, int64_t b, int64_t e,
                                   const AdamwStep& k) {
  const __m256 clip = _mm256_set1_ps(k.clip), b1 = _mm256_set1_ps(k.b1), c1 = _mm256_set1_ps(1.0f - k.b1);
  const __m256 b2 = _mm256_set1_ps(k.b2), c2 = _mm256_set1_ps(1.0f - k.b2), decay = _mm256_set1_ps(k.decay);
  const __m256 step = _mm256_set1_ps(k.step_size), sbc2 = _mm256_set1_ps(k.sqrt_bc2), eps = _mm256_set1_ps(k.eps);
  int64_t i = b;
  for (; i + 8 <= e; i += 8) {
    const __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(g + i), clip);
    const __m256 mi = _mm256_add_ps(_mm256_mul_ps(b1, _mm256_loadu_ps(m + i)), _mm256_mul_ps(c1, gi));
    const __m256 vi = _mm256_add_ps(_mm256_mul_ps(b2, _mm256_loadu_ps(v + i)), _mm256_mul_ps(_mm256_mul_ps(c2, gi), gi));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), sbc2), eps);
    const __m256 pi = _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(p + i), decay),
                                    _mm256_div_ps(_mm256_mul_ps(step, mi), denom));
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    _mm256_storeu_ps(p + i, pi);
  }
  for (; i < e; ++i) {
    const float gi = g[i] * k.clip;
    m[i] = k.b1 * m[i] + (1.0f - k.b1) * gi;
    v[i] = k.b2 * v[i] + (1.0f - k.b2) * gi * gi;
    p[i] = p[i] * k.decay - k.step_size * m[i] / (std::sqrt(v[i]) / k.sqrt_bc2 + k.eps);
  }
}

// m == nullptr: no momentum. Plain loops: the compiler vectorizes them for AVX2.
FLOWRUN_AVX2 void sgd_cpu_kernel(float* p, const float* g, float* m, int64_t b, int64_t e, const SgdStep& k) {
  if (m) {
    for (int64_t i = b; i < e; ++i) {
      m[i] = k.momentum * m[i] + g[i] * k.clip;
      p[i] = p[i] * k.decay - k.lr * m[i];
    }
  } else {
    for (int64_t i = b; i < e; ++i) p[i] = p[i] * k.decay - k.lr * (g[i] * k.clip);
  }
}
#else
void adamw_cpu_kernel(float*, const float*, float*, float*, int64_t, int64_t, const AdamwStep&) {}
void sgd_cpu_kernel(float*, const float*, float*, int64_t, int64_t, const SgdStep&) {}
#endif

// One tensor's share of a CPU update: its pointers and the constants of its step.
struct CpuPiece {
  float* p;
  const float* g;
  float* m;  // adamw: first moment; sgd: momentum (or nullptr)
  float* v;  // adamw: second moment
  int64_t n;
  AdamwStep adamw;
  SgdStep sgd;
};

// Runs fn(piece, begin, end) over the elements of all pieces as one index range, cut into
// chunks of kChunk elements that the OpenMP threads share: one parallel region per update, not
// one per tensor, and small tensors share a chunk (multi-tensor apply, as torch's _foreach
// kernels on a GPU). The chunks do not depend on the number of threads.
constexpr int64_t kChunk = 32768;

template <class Fn>
void for_each_chunk(const std::vector<CpuPiece>& pieces, const Fn& fn) {
  std::vector<int64_t> start(pieces.size() + 1, 0);
  for (size_t j = 0; j < pieces.size(); ++j) start[j + 1] = start[j] + pieces[j].n;
  const int64_t total = start.back();
  at::parallel_for(0, (total + kChunk - 1) / kChunk, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const int64_t b = c * kChunk, e = std::min(total, b + kChunk);
      auto j = static_cast<size_t>(std::upper_bound(start.begin(), start.end(), b) - start.begin() - 1);
      for (; j < pieces.size() && start[j] < e; ++j)
        fn(pieces[j], std::max(b, start[j]) - start[j], std::min(e, start[j + 1]) - start[j]);
    }
  });
}

// The CPU pass above for every parameter it applies to (fp32, contiguous, on the CPU, with a
// gradient; its moments made); marks them in `done`. Nothing on CPUs without AVX2.
void cpu_update(OptimizerState& st, const ModelState::Named& params, const Grads& grads, const OptimConfig& cfg,
                double lr, float clip, std::vector<char>& done) {
  if (!cpu_has_avx2() || cfg.kind == OptimKind::adafactor) return;
  auto ok = [](const torch::Tensor& t) {
    return t.defined() && t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous();
  };
  const bool adamw = cfg.kind == OptimKind::adamw;
  const bool momentum = !adamw && cfg.momentum > 0;
  std::vector<CpuPiece> pieces;
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& p = params[i].second;
    const torch::Tensor& g = grads[i];
    OptimizerState::Slot& s = st.slots[i];
    if (!ok(p) || !ok(g)) continue;
    if (adamw ? !(ok(s.exp_avg) && ok(s.exp_avg_sq)) : momentum && !ok(s.momentum)) continue;
    s.step += 1;
    const float decay = cfg.weight_decay > 0 && decays(p) ? static_cast<float>(1.0 - lr * cfg.weight_decay) : 1.0f;
    CpuPiece c{p.data_ptr<float>(), g.data_ptr<float>(), nullptr, nullptr, p.numel(), {}, {}};
    if (adamw) {
      const double t = static_cast<double>(s.step);
      const double bc1 = 1.0 - std::pow(cfg.beta1, t), bc2 = 1.0 - std::pow(cfg.beta2, t);
      c.m = s.exp_avg.data_ptr<float>();
      c.v = s.exp_avg_sq.data_ptr<float>();
      c.adamw = {clip, static_cast<float>(cfg.beta1), static_cast<float>(cfg.beta2), decay,
                 static_cast<float>(lr / bc1), static_cast<float>(std::sqrt(bc2)), static_cast<float>(cfg.eps)};
    } else {
      if (momentum) c.m = s.momentum.data_ptr<float>();
      c.sgd = {clip, decay, static_cast<float>(lr), static_cast<float>(cfg.momentum)};
    }
    pieces.push_back(c);
    done[i] = 1;
    // Written through pointers: tell autograd the tensors changed, as in-place ops would.
    for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&p, &s.exp_avg, &s.exp_avg_sq, &s.momentum})
      if (t->defined()) torch::autograd::impl::bump_version(*t);
  }
  if (adamw)
    for_each_chunk(pieces, [](const CpuPiece& c, int64_t b, int64_t e) { adamw_cpu_kernel(c.p, c.g, c.m, c.v, b, e, c.adamw); });
  else
    for_each_chunk(pieces, [](const CpuPiece& c, int64_t b, int64_t e) { sgd_cpu_kernel(c.p, c.g, c.m, b, e, c.sgd); });
}

// The slots for these parameters, their moments zeroed in flat buffers (see OptimizerState),
// and what load() kept for them.
void make_slots(OptimizerState& st, const ModelState::Named& params, const OptimConfig& cfg) {
  st.slots.resize(params.size());
  std::vector<torch::Tensor> ps;
  for (size_t i = 0; i < params.size(); ++i) {
    st.slots[i].name = params[i].first;
    ps.push_back(params[i].second);
  }
  st.layout = FlatLayout::of(ps);
  auto make = [&](std::vector<torch::Tensor>& flat, torch::Tensor OptimizerState::Slot::*moment) {
    flat = st.layout.zeros();
    for (size_t i = 0; i < ps.size(); ++i) st.slots[i].*moment = st.layout.view(flat, i, ps[i].sizes());
  };
  if (cfg.kind == OptimKind::adamw) {
    make(st.flat_exp_avg, &OptimizerState::Slot::exp_avg);
    make(st.flat_exp_avg_sq, &OptimizerState::Slot::exp_avg_sq);
  } else if (cfg.kind == OptimKind::sgd && cfg.momentum > 0) {
    make(st.flat_momentum, &OptimizerState::Slot::momentum);
  } else if (cfg.kind == OptimKind::adafactor) {
    if (cfg.adafactor.momentum > 0) make(st.flat_exp_avg, &OptimizerState::Slot::exp_avg);
    // The second moments are shaped otherwise (factored: a row and a column statistic), so
    // they are tensors of their own.
    for (size_t i = 0; i < ps.size(); ++i) {
      OptimizerState::Slot& s = st.slots[i];
      const auto [a, b] = adafactor_factored_dims(ps[i].sizes(), cfg.adafactor.min_dim_size_to_factor);
      if (a >= 0) {
        s.v_row = torch::zeros_like(ps[i].select(a, 0), at::MemoryFormat::Contiguous);
        s.v_col = torch::zeros_like(ps[i].select(b, 0), at::MemoryFormat::Contiguous);
      } else {
        s.v = torch::zeros_like(ps[i], at::MemoryFormat::Contiguous);
      }
    }
  }
}

// The saved moments of a slot: copied into its moments where they exist (views into the flat
// buffers, on the parameter's device), else copies on `device` (the given tensors may be
// aliases their owner goes on changing; a checkpoint is read onto the CPU).
void load_slot(OptimizerState::Slot& s, const std::map<std::string, torch::Tensor>& t, const c10::Device& device) {
  torch::NoGradGuard no_grad;
  auto get = [&](const std::string& suffix, torch::Tensor& dst) {
    auto it = t.find(s.name + suffix);
    if (it == t.end()) return;
    if (!dst.defined()) {
      dst = it->second.detach().to(device, /*non_blocking=*/false, /*copy=*/true);
      return;
    }
    if (!dst.sizes().equals(it->second.sizes()))
      throw std::runtime_error("optimizer state: '" + s.name + suffix + "' has shape " + shape_str(it->second) +
                               ", the parameter is " + shape_str(dst) +
                               "; the state was saved for another model");
    dst.copy_(it->second);
  };
  get(".exp_avg", s.exp_avg);
  get(".exp_avg_sq", s.exp_avg_sq);
  get(".momentum_buffer", s.momentum);
  get(".v_row", s.v_row);
  get(".v_col", s.v_col);
  get(".v", s.v);
  auto it = t.find(s.name + ".step");
  if (it != t.end()) s.step = it->second.item<int64_t>();
}

}  // namespace

void OptimizerState::load(const std::map<std::string, torch::Tensor>& t) {
  fused_step = torch::Tensor();  // the loaded steps rule
  auto it = t.find("updates");
  if (it != t.end()) updates = it->second.item<int64_t>();
  if (slots.empty()) {
    // Copies now: the given tensors may be aliases that their owner goes on changing.
    pending.clear();
    for (const auto& [k, v] : t) pending[k] = v.detach().clone();
    return;
  }
  // Slots exist once an update ran, with moments where their parameters live.
  for (Slot& s : slots) {
    const torch::Tensor& m = s.exp_avg.defined() ? s.exp_avg : s.momentum;
    load_slot(s, t, m.defined() ? m.device() : c10::Device(c10::kCPU));
  }
}

torch::Tensor global_norm(const Grads& grads) {
  std::vector<torch::Tensor> given;
  given.reserve(grads.size());
  for (const auto& g : grads)
    if (g.defined()) given.push_back(g);
  if (given.empty()) return torch::zeros({}, torch::kFloat);
  bool foreach = !given.front().is_cpu();
  for (const auto& g : given)
    foreach = foreach && g.scalar_type() == torch::kFloat && g.device() == given.front().device();
  std::vector<torch::Tensor> norms;
  if (foreach) {
    norms = at::_foreach_norm(given, 2);
  } else {
    norms.reserve(given.size());
    for (const auto& g : given) norms.push_back(at::linalg_vector_norm(g, 2, c10::nullopt, false, torch::kFloat));
  }
  return at::linalg_vector_norm(torch::stack(norms), 2);
}

int64_t nonfinite_count(const OptimizerState& st) {
  return st.nonfinite.defined() ? static_cast<int64_t>(st.nonfinite.item<double>()) : 0;
}

torch::Tensor optimizer_update(OptimizerState& st, const ModelState::Named& params, const Grads& grads,
                               const OptimConfig& cfg, double lr) {
  torch::NoGradGuard no_grad;
  if (grads.size() != params.size())
    throw std::runtime_error("got " + std::to_string(grads.size()) + " grads for " + std::to_string(params.size()) +
                             " trainable parameters");
  const bool adamw = cfg.kind == OptimKind::adamw;
  for (size_t i = 0; i < params.size(); ++i)
    if (grads[i].defined() && !grads[i].sizes().equals(params[i].second.sizes()))
      throw std::runtime_error("grad " + std::to_string(i) + " (" + params[i].first + ") has shape " +
                               shape_str(grads[i]) + ", the parameter " + shape_str(params[i].second));
  if (st.slots.empty()) {
    make_slots(st, params, cfg);
    if (!st.pending.empty()) {
      for (size_t i = 0; i < params.size(); ++i) load_slot(st.slots[i], st.pending, params[i].second.device());
      st.pending.clear();
    }
  } else if (st.slots.size() != params.size()) {
    throw std::runtime_error("the model has " + std::to_string(params.size()) + " trainable parameters, the optimizer " +
                             "state was made for " + std::to_string(st.slots.size()));
  }

  torch::Tensor norm = global_norm(grads);
  torch::Tensor coef;  // clip factor, kept on the device (no host sync)
  if (cfg.clip > 0) coef = torch::clamp_max(cfg.clip / (norm + 1e-6), 1.0);

  // Where the device can skip a non-finite step itself, the flag goes into the kernel and no
  // host reads it (defer_nonfinite); the count stays on the device too.
  if (adamw && cfg.defer_nonfinite && fused_adamw_applies(st, params, grads)) {
    const torch::Tensor found = norm.isfinite().logical_not().to(torch::kFloat);
    st.nonfinite = st.nonfinite.defined() ? st.nonfinite.add_(found) : found.clone();
    fused_adamw(st, params, grads, cfg, lr, coef, found);
    st.updates += 1;
    return norm;
  }
  if (!std::isfinite(norm.item<double>())) {
    if (cfg.skip_nonfinite || cfg.defer_nonfinite) {  // the caller counts and reports skipped steps
      torch::Tensor one = torch::ones({}, norm.options().dtype(torch::kFloat));
      st.nonfinite = st.nonfinite.defined() ? st.nonfinite.add_(one) : one;
      return norm;
    }
    throw NonFiniteGrads("the gradients are not finite (global norm " + std::to_string(norm.item<double>()) +
                         "): the loss diverged or overflowed; lower the lr, add clip, or set skip_nonfinite: true");
  }
  if (adamw && fused_adamw_applies(st, params, grads)) {
    fused_adamw(st, params, grads, cfg, lr, coef, torch::Tensor());
    st.updates += 1;
    return norm;
  }
  settle_fused_step(st);  // the paths below count steps on the host
  // The clip factor as a number, for the CPU kernels (a CPU tensor: reading it costs no sync).
  const float clip_cpu = coef.defined() && coef.device().is_cpu() ? coef.item<float>() : 1.0f;
  std::vector<char> done(params.size(), 0);
  cpu_update(st, params, grads, cfg, lr, clip_cpu, done);
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& g0 = grads[i];
    if (done[i] || !g0.defined()) continue;
    torch::Tensor p = params[i].second;
    OptimizerState::Slot& s = st.slots[i];
    torch::Tensor g = coef.defined() ? g0 * coef.to(g0.dtype()) : g0;
    s.step += 1;
    if (cfg.weight_decay > 0 && decays(p)) p.mul_(1.0 - lr * cfg.weight_decay);
    if (cfg.kind == OptimKind::adafactor) {
      p.add_(adafactor_direction(s, g, cfg.adafactor), -lr);
    } else if (adamw) {
      if (!s.exp_avg.defined()) s.exp_avg = torch::zeros_like(p, at::MemoryFormat::Preserve);
      if (!s.exp_avg_sq.defined()) s.exp_avg_sq = torch::zeros_like(p, at::MemoryFormat::Preserve);
      s.exp_avg.mul_(cfg.beta1).add_(g, 1.0 - cfg.beta1);
      s.exp_avg_sq.mul_(cfg.beta2).addcmul_(g, g, 1.0 - cfg.beta2);
      const double t = static_cast<double>(s.step);
      const double bc1 = 1.0 - std::pow(cfg.beta1, t), bc2 = 1.0 - std::pow(cfg.beta2, t);
      torch::Tensor denom = (s.exp_avg_sq.sqrt() / std::sqrt(bc2)).add_(cfg.eps);
      p.addcdiv_(s.exp_avg, denom, -lr / bc1);
    } else if (cfg.momentum > 0) {
      if (!s.momentum.defined())
        s.momentum = g.detach().clone();
      else
        s.momentum.mul_(cfg.momentum).add_(g);
      p.add_(s.momentum, -lr);
    } else {
      p.add_(g, -lr);
    }
  }
  st.updates += 1;
  return norm;
}

namespace {

class OptimizerNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const Params& p = ctx.params();
    cfg_.kind = optim_kind(p.get<std::string>("kind"));
    cfg_.momentum = p.get<double>("momentum");
    cfg_.beta1 = p.get<double>("beta1");
    cfg_.beta2 = p.get<double>("beta2");
    cfg_.eps = p.get<double>("eps");
    cfg_.weight_decay = p.get<double>("weight_decay");
    cfg_.clip = p.get<double>("clip");
    sched_.lr = p.get<double>("lr");
    sched_.warmup = p.get<int64_t>("warmup");
    sched_.kind = lr_decay(p.get<std::string>("schedule"));
    sched_.min_lr = p.get<double>("min_lr");
    cfg_.skip_nonfinite = p.get<bool>("skip_nonfinite");
    // On a GPU no step reads the grad norm on the host: non-finite steps are skipped on the
    // device and counted, and the count is read on logged steps (check_nonfinite). On the CPU
    // reading it costs nothing, so the step that diverged stops the run itself.
    cfg_.defer_nonfinite = !run_device(ctx.run()).is_cpu();
    if (cfg_.kind == OptimKind::adafactor) {
      const YAML::Node a = p["adafactor"];
      cfg_.adafactor.decay_rate = a["decay_rate"].as<double>();
      cfg_.adafactor.beta2_cap = a["beta2_cap"].as<double>();
      cfg_.adafactor.eps = a["eps"].as<double>();
      cfg_.adafactor.min_dim_size_to_factor = a["min_dim_size_to_factor"].as<int64_t>();
      cfg_.adafactor.clipping_threshold = a["clipping_threshold"].IsNull() ? 0.0 : a["clipping_threshold"].as<double>();
      cfg_.adafactor.momentum = a["momentum"].as<double>();
    }
    ctx.own_state("state", std::make_shared<OptimizerState>());
  }

  void run(StepContext& ctx) override {
    const Grads& grads = ctx.in<Grads>("grads");
    ModelState& model = ctx.state_as<ModelState>("model");
    OptimizerState& st = ctx.state_as<OptimizerState>("state");
    const double lr = sched_.at(ctx.step(), ctx.run().last_step);
    // The writer of the parameters keeps them in flat buffers (models/model_state.hpp); once
    // they are, this only checks that they still are.
    model.flat.ensure(model.trainable_parameters());
    torch::Tensor norm = optimizer_update(st, model.named_parameters(/*trainable_only=*/true), grads, cfg_, lr);
    const int64_t step = ctx.step();
    if (!cfg_.defer_nonfinite) {
      if (cfg_.skip_nonfinite && !std::isfinite(norm.item<double>()))
        spdlog::warn("{}: step {}: gradients not finite, update skipped ({} skipped so far)", ctx.who(), step,
                     nonfinite_count(st));
    } else if (step % ctx.run().log_every == 0 || step == ctx.run().last_step) {
      check_nonfinite(ctx, st, step);
    }
    ctx.out("lr", lr);
    ctx.out("grad_norm", norm);
  }

 private:
  // defer_nonfinite: what the device counted since the last check, told (skip_nonfinite) or
  // stopping the run (the updates were skipped on the device, so the parameters are those of
  // the last finite step).
  void check_nonfinite(StepContext& ctx, const OptimizerState& st, int64_t step) {
    const int64_t count = nonfinite_count(st);
    const int64_t since = checked_ >= 0 ? checked_ + 1 : ctx.run().first_step;
    checked_ = step;
    if (count == reported_) return;
    const std::string when = since == step ? "at step " + std::to_string(step)
                                           : "between step " + std::to_string(since) + " and step " + std::to_string(step);
    const int64_t fresh = count - reported_;
    reported_ = count;
    if (!cfg_.skip_nonfinite)
      throw NonFiniteGrads("the gradients were not finite in " + std::to_string(fresh) + " step(s) " + when +
                           " (those updates were skipped on the device): the loss diverged or overflowed; lower the "
                           "lr, add clip, or set skip_nonfinite: true");
    spdlog::warn("{}: {} step(s) with non-finite gradients {}, their updates skipped ({} skipped so far)", ctx.who(),
                 fresh, when, count);
  }

  OptimConfig cfg_;
  LrSchedule sched_;
  int64_t reported_ = 0;  // defer_nonfinite: skipped updates told so far
  int64_t checked_ = -1;  // the step of the last check (-1: none yet)
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(optimizer, flowrun::OptimizerNode)
FLOWRUN_STATE_TYPE(flowrun::OptimizerState)  // saved and restored by checkpoint/resume
