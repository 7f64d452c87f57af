// Diagnostics: every problem found in a graph file, with where it is and what to do.
// The checker collects all of them (never stops at the first) and prints them as
//   FILE:LINE:COL: key.path: message
#pragma once
#include <stdexcept>
#include <string>
#include <vector>

namespace flowrun {

// A position in a source file; line and column are 1-based, 0 means unknown.
struct Mark {
  std::string file;
  int line = 0;
  int col = 0;
};

struct Diagnostic {
  Mark mark;
  std::string path;     // key path, e.g. "nodes.opt.with.lr"
  std::string message;  // what is wrong and how to fix it
  std::string str() const;
};

class Diagnostics {
 public:
  void error(const Mark& m, std::string path, std::string message);
  bool empty() const { return list_.empty(); }
  size_t size() const { return list_.size(); }
  const std::vector<Diagnostic>& list() const { return list_; }
  std::string str() const;  // one diagnostic per line
  void append(const Diagnostics& other);

 private:
  std::vector<Diagnostic> list_;
};

// Thrown when a graph file cannot be used; carries every diagnostic. The CLI exits 2 on it.
class GraphError : public std::runtime_error {
 public:
  explicit GraphError(Diagnostics d);
  const Diagnostics& diagnostics() const { return diags_; }

 private:
  Diagnostics diags_;
};

// Edit distance, for "did you mean".
int edit_distance(const std::string& a, const std::string& b);
// " (did you mean 'x'?)" for the closest candidate within a sensible distance, else "".
std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates);
// "a, b, c" for listing what is allowed.
std::string join(const std::vector<std::string>& items, const std::string& sep = ", ");

}  // namespace flowrun
