// load_yaml: YAML text to a node, refusing what yaml-cpp would otherwise accept silently or
// crash on. Every YAML text flowrun reads from a user (graph files, overrides, node schemas)
// comes through here.
//
// One pass over yaml-cpp's event stream before YAML::Load builds nodes:
//   - an alias inside its own anchor (`&r { self: *r }`) makes a node that contains itself;
//     every walk over it recurses forever. Refused where the alias is.
//   - aliases copy their anchor's subtree: ten levels of ten aliases ("billion laughs") are
//     1e10 nodes to any walk. The pass counts each node as often as aliases make it appear and
//     refuses a document over kYamlMaxNodes.
//   - nesting deeper than kYamlMaxDepth is refused (flowrun's own walks are recursive).
//   - a key given twice in one map is refused (yaml-cpp keeps both; lookups see one).
//   - keys are plain scalars (a list or map as a key has no name to look up).
//   - a second document (`---`) is refused instead of ignored.
// Syntax errors keep yaml-cpp's message with the line and column.
#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/parser.h>

#include <map>
#include <set>
#include <sstream>

#include "schema.hpp"

namespace flowrun {

namespace {

Mark at(const std::string& file, const YAML::Mark& m) { return {file, m.line + 1, m.column + 1}; }

class Guard : public YAML::EventHandler {
 public:
  Guard(std::string file, Diagnostics& diags) : file_(std::move(file)), diags_(diags) {}

  struct Refused {};  // the text cannot be loaded (the first such problem is reported)
  struct Done {};     // stop reading: what follows is a second document

  void OnDocumentStart(const YAML::Mark& m) override {
    if (documents_++ > 0) {
      diags_.error(at(file_, m), "", "a second YAML document starts here ('---'); flowrun reads one document per file: "
                                   "remove the '---' line or split the file");
      throw Done{};  // its contents are not read
    }
  }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark& m, YAML::anchor_t anchor) override { leaf(m, anchor, nullptr); }
  void OnScalar(const YAML::Mark& m, const std::string&, YAML::anchor_t anchor, const std::string& value) override {
    leaf(m, anchor, &value);
  }
  void OnAlias(const YAML::Mark& m, YAML::anchor_t anchor) override {
    aliased = true;
    for (const auto& f : stack_)
      if (f.anchor == anchor && anchor != YAML::NullAnchor)
        refuse(m, "this alias is inside the node its anchor names, so that node would contain itself; "
                  "an alias can only name a node that is complete");
    const auto it = size_.find(anchor);
    if (it == size_.end()) refuse(m, "alias to an unknown anchor");
    if (key_position()) refuse(m, "a map key is a plain name, not an alias");
    add(m, it->second);
    child_done();
  }
  void OnSequenceStart(const YAML::Mark& m, const std::string&, YAML::anchor_t anchor, YAML::EmitterStyle::value) override {
    open(m, anchor, false);
  }
  void OnSequenceEnd() override { close(); }
  void OnMapStart(const YAML::Mark& m, const std::string&, YAML::anchor_t anchor, YAML::EmitterStyle::value) override {
    open(m, anchor, true);
  }
  void OnMapEnd() override { close(); }

  bool aliased = false;  // the document holds an alias

 private:
  struct Frame {
    YAML::anchor_t anchor;
    bool is_map;
    bool at_key = true;    // maps: the next child is a key
    uint64_t nodes = 1;    // this node and everything below it, aliases expanded
    std::set<std::string> keys;
  };

  [[noreturn]] void refuse(const YAML::Mark& m, const std::string& what) {
    diags_.error(at(file_, m), "", what);
    throw Refused{};
  }

  bool key_position() const { return !stack_.empty() && stack_.back().is_map && stack_.back().at_key; }

  void add(const YAML::Mark& m, uint64_t n) {
    total_ += n;
    if (total_ > kYamlMaxNodes)
      refuse(m, "the document expands to more than " + std::to_string(kYamlMaxNodes) +
                    " nodes through its aliases (an alias bomb?); a graph file is far smaller: copy what you need instead");
    if (!stack_.empty()) stack_.back().nodes += n;
  }

  void child_done() {
    if (!stack_.empty() && stack_.back().is_map) stack_.back().at_key = !stack_.back().at_key;
  }

  void leaf(const YAML::Mark& m, YAML::anchor_t anchor, const std::string* value) {
    if (key_position()) {
      if (!value) refuse(m, "a map key is missing (null key)");
      if (!stack_.back().keys.insert(*value).second)  // reported; the checker goes on to find more
        diags_.error(at(file_, m), "", "duplicate key '" + *value + "' in this map; only one of them would be used: remove or rename one");
    }
    add(m, 1);
    if (anchor != YAML::NullAnchor) size_[anchor] = 1;
    child_done();
  }

  void open(const YAML::Mark& m, YAML::anchor_t anchor, bool is_map) {
    if (key_position()) refuse(m, "a map key is a plain name, not a " + std::string(is_map ? "map" : "list"));
    if (static_cast<int>(stack_.size()) >= kYamlMaxDepth)
      refuse(m, "nested more than " + std::to_string(kYamlMaxDepth) + " levels deep; a graph file needs a few");
    ++total_;
    stack_.push_back(Frame{anchor, is_map});
  }

  void close() {
    Frame f = std::move(stack_.back());
    stack_.pop_back();
    if (f.anchor != YAML::NullAnchor) size_[f.anchor] = f.nodes;
    if (!stack_.empty()) stack_.back().nodes += f.nodes;
    child_done();
  }

  std::string file_;
  Diagnostics& diags_;
  std::vector<Frame> stack_;
  std::map<YAML::anchor_t, uint64_t> size_;  // anchor -> its expanded node count
  uint64_t total_ = 0;
  int documents_ = 0;
};

}  // namespace

YAML::Node load_yaml(const std::string& text, const std::string& file, Diagnostics& diags, bool* aliased) {
  Guard guard(file, diags);
  try {
    std::istringstream in(text);
    YAML::Parser parser(in);
    while (parser.HandleNextDocument(guard)) {
    }
  } catch (const Guard::Done&) {
  } catch (const Guard::Refused&) {
    throw GraphError(diags);
  } catch (const YAML::DeepRecursion& e) {
    diags.error(at(file, e.mark), "", "nested more than " + std::to_string(kYamlMaxDepth) + " levels deep; a graph file needs a few");
    throw GraphError(diags);
  } catch (const YAML::ParserException& e) {
    diags.error(at(file, e.mark), "", "YAML syntax error: " + e.msg);
    throw GraphError(diags);
  }
  if (aliased) *aliased = guard.aliased;
  return YAML::Load(text);  // the same text again (its first document): it cannot fail now
}

}  // namespace flowrun
