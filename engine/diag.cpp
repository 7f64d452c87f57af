#include "diag.hpp"

#include <algorithm>
#include <sstream>

namespace flowrun {

std::string Diagnostic::str() const {
  std::ostringstream o;
  o << (mark.file.empty() ? "<input>" : mark.file);
  if (mark.line > 0) o << ':' << mark.line << ':' << mark.col;
  o << ": ";
  if (!path.empty()) o << path << ": ";
  o << message;
  return o.str();
}

void Diagnostics::error(const Mark& m, std::string path, std::string message) {
  list_.push_back({m, std::move(path), std::move(message)});
}

std::string Diagnostics::str() const {
  std::string s;
  for (const auto& d : list_) s += d.str() + "\n";
  return s;
}

void Diagnostics::append(const Diagnostics& other) {
  list_.insert(list_.end(), other.list_.begin(), other.list_.end());
}

GraphError::GraphError(Diagnostics d)
    : std::runtime_error(d.str().empty() ? "invalid graph" : d.str()), diags_(std::move(d)) {}

// Optimal string alignment distance: insertions, deletions, substitutions and swaps of two
// neighbours ("stesp" -> "steps" is one edit) each cost 1.
int edit_distance(const std::string& a, const std::string& b) {
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<int>> d(n + 1, std::vector<int>(m + 1));
  for (size_t i = 0; i <= n; ++i) d[i][0] = static_cast<int>(i);
  for (size_t j = 0; j <= m; ++j) d[0][j] = static_cast<int>(j);
  for (size_t i = 1; i <= n; ++i)
    for (size_t j = 1; j <= m; ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[n][m];
}

std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates) {
  const std::string* best = nullptr;
  int best_d = 1 << 30;
  for (const auto& c : candidates) {
    int d = edit_distance(word, c);
    if (d < best_d) best_d = d, best = &c;
  }
  // One edit for short words, more for longer ones: "lrr" -> "lr", "nodz" -> "nodes", not "x" -> "lr".
  const int limit = word.size() <= 3 ? 1 : word.size() <= 7 ? 2 : 3;
  if (best && best_d <= limit) return " (did you mean '" + *best + "'?)";
  return "";
}

std::string join(const std::vector<std::string>& items, const std::string& sep) {
  std::string s;
  for (size_t i = 0; i < items.size(); ++i) s += (i ? sep : "") + items[i];
  return s;
}

}  // namespace flowrun
