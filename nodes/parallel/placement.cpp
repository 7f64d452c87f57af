#include "parallel/placement.hpp"

#include <functional>

namespace flowrun::parallel {

namespace {

// The split as it applies to a tensor of `dims` dimensions over `ranks` ranks.
TpSplit usable(const TpSplit& s, size_t dims, int ranks) {
  return ranks > 1 && s.split() && static_cast<size_t>(s.dim) < dims ? s : TpSplit{};
}

// A box of this rank's tensor (local offsets `at`, data `view` of its sizes) placed in the whole:
// cut at the split's runs, each run's block moved to its place in the whole.
void place(std::vector<TensorPiece>& out, const std::string& name, const std::vector<int64_t>& local,
           const std::vector<int64_t>& at, const torch::Tensor& view, const Placement& p) {
  const TpSplit s = usable(p.split, local.size(), p.ranks);
  std::vector<int64_t> whole = local;
  if (!s.split()) {
    out.push_back({name, whole, at, view});
    return;
  }
  const auto d = static_cast<size_t>(s.dim);
  whole[d] *= p.ranks;
  const int64_t block = local[d] / s.runs;  // this rank's part of one run
  const int64_t run = whole[d] / s.runs;    // one run of the whole
  const int64_t lo = at[d], hi = at[d] + view.size(s.dim);
  for (int64_t k = 0; k < s.runs; ++k) {
    const int64_t a = std::max(lo, k * block), b = std::min(hi, (k + 1) * block);
    if (a >= b) continue;
    std::vector<int64_t> offsets = at;
    offsets[d] = k * run + p.rank * block + (a - k * block);
    out.push_back({name, whole, offsets, view.narrow(s.dim, a - lo, b - a)});
  }
}

}  // namespace

void add_pieces(std::vector<TensorPiece>& out, const std::string& name, const torch::Tensor& local, const Placement& p) {
  if (!local.defined()) return;
  place(out, name, local.sizes().vec(), std::vector<int64_t>(static_cast<size_t>(local.dim()), 0), local, p);
}

void add_range_pieces(std::vector<TensorPiece>& out, const std::string& name, const torch::Tensor& data,
                      const std::vector<int64_t>& local, int64_t offset, const Placement& p) {
  const int64_t n = data.numel();
  if (n == 0) return;
  if (offset < 0 || offset + n > c10::multiply_integers(local))
    throw std::logic_error("placement: elements [" + std::to_string(offset) + ", " + std::to_string(offset + n) + ") of '" +
                           name + "', which has " + std::to_string(c10::multiply_integers(local)));
  if (local.empty()) {  // a 0-d tensor
    place(out, name, local, {}, data.view({}), p);
    return;
  }
  torch::Tensor flat = data.reshape({-1});
  int64_t used = 0;  // elements of `data` given to boxes so far (the boxes come in range order)
  // The elements [b, e) of the sub-box at `at` (dims < dim fixed at at[..], dims >= dim whole).
  std::function<void(size_t, std::vector<int64_t>, int64_t, int64_t)> cut = [&](size_t dim, std::vector<int64_t> at,
                                                                               int64_t b, int64_t e) {
    std::vector<int64_t> rest(local.begin() + static_cast<std::ptrdiff_t>(dim), local.end());
    const int64_t stride = c10::multiply_integers(rest) / local[dim];  // elements of one index along dim
    auto emit = [&](int64_t first, int64_t count) {  // indices [first, first + count) along dim, the rest whole
      std::vector<int64_t> sizes(local.size(), 1), offs = at;
      for (size_t k = dim; k < local.size(); ++k) sizes[k] = local[k];
      sizes[dim] = count;
      offs[dim] = first;
      const int64_t m = c10::multiply_integers(sizes);
      place(out, name, local, offs, flat.narrow(0, used, m).view(sizes), p);
      used += m;
    };
    if (b == e) return;
    if (dim + 1 == local.size()) return emit(b, e - b);
    if (b / stride == (e - 1) / stride) {  // inside one index
      at[dim] = b / stride;
      return cut(dim + 1, at, b - at[dim] * stride, e - at[dim] * stride);
    }
    int64_t i0 = b / stride;
    const int64_t i1 = e / stride;
    if (b % stride != 0) {  // a partial first index
      std::vector<int64_t> a = at;
      a[dim] = i0;
      cut(dim + 1, a, b - i0 * stride, stride);
      ++i0;
    }
    if (i1 > i0) emit(i0, i1 - i0);  // whole indices
    if (e % stride != 0) {           // a partial last index
      std::vector<int64_t> a = at;
      a[dim] = i1;
      cut(dim + 1, a, 0, e - i1 * stride);
    }
  };
  cut(0, std::vector<int64_t>(local.size(), 0), offset, offset + n);
  if (used != n) throw std::logic_error("placement: the boxes of a range of '" + name + "' missed elements");
}

}  // namespace flowrun::parallel
