// The update rules' registry (update_rule.hpp): built-in rules register at load time, plugin
// ones while their plugin loads, each adding its name to the optimizer's `kind` and its group.
#include "train/update_rule.hpp"

#include <map>
#include <mutex>

#include "diag.hpp"

namespace flowrun {

namespace {
struct Rules {
  std::mutex mu;
  std::map<std::string, RuleFactory> factories;
};
Rules& registered_rules() {
  static Rules r;
  return r;
}
}  // namespace

void register_update_rule(const std::string& name, RuleFactory factory) {
  Rules& r = registered_rules();
  std::lock_guard<std::mutex> lock(r.mu);
  r.factories[name] = std::move(factory);
}

void add_update_rule(Registry& reg, const std::string& group_yaml, RuleFactory factory, const std::string& origin) {
  ParamGroup g = parse_param_group(group_yaml, origin);
  {
    Rules& r = registered_rules();
    std::lock_guard<std::mutex> lock(r.mu);
    if (r.factories.count(g.name))
      throw std::runtime_error(origin + ": the optimizer already has an update rule '" + g.name +
                               "'; name the plugin's rule otherwise");
    r.factories[g.name] = std::move(factory);
  }
  reg.extend("optimizer", [&](NodeSchema& s) {
    for (auto& p : s.params)
      if (p.name == "kind") p.values.push_back(g.name);
    ParamSchema settings;
    settings.name = g.name;
    settings.type = ParamType::Map;
    settings.fields = g.params;
    settings.when_param = "kind";
    settings.when_values = {g.name};
    settings.doc = "kind " + g.name + " (from " + origin + "): " + g.doc;
    s.params.push_back(std::move(settings));
  });
}

std::shared_ptr<const UpdateRule> make_update_rule(const std::string& kind, const Params& settings) {
  RuleFactory f;
  {
    Rules& r = registered_rules();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.factories.find(kind);
    if (it != r.factories.end()) f = it->second;
  }
  if (!f)
    throw std::invalid_argument("unknown optimizer kind '" + kind + "'; registered update rules: " +
                                join(update_rule_names()) + " (a plugin's rule needs its library under plugins:)");
  std::shared_ptr<UpdateRule> rule = f(settings);
  rule->kind = kind;
  return rule;
}

std::shared_ptr<const UpdateRule> make_update_rule(const std::string& kind, const std::string& settings_yaml) {
  const NodeType* t = Registry::global().find("optimizer");
  const ParamSchema* group = t ? t->schema.param(kind) : nullptr;
  Diagnostics diags;
  YAML::Node given = YAML::Load(settings_yaml);
  YAML::Node filled = group ? check_param(*group, given, "<" + kind + " settings>", kind, diags) : given;
  if (!diags.empty()) throw GraphError(diags);
  return make_update_rule(kind, Params(filled, "optimizer", kind + "."));
}

std::vector<std::string> update_rule_names() {
  Rules& r = registered_rules();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> out;
  for (const auto& [name, f] : r.factories) out.push_back(name);
  return out;
}

}  // namespace flowrun
