// The flowrun subcommands. Each returns the process exit code:
// 0 ok, 1 a node failed, 2 an invalid graph file or bad usage, 130 stopped by SIGINT.
#pragma once
#include <string>
#include <vector>

namespace flowrun::cli {

int cmd_run(const std::vector<std::string>& args);
int cmd_validate(const std::vector<std::string>& args);
int cmd_dot(const std::vector<std::string>& args);
int cmd_explain(const std::vector<std::string>& args);
int cmd_nodes(const std::vector<std::string>& args);
int cmd_plan(const std::vector<std::string>& args);  // plan.cpp
int cmd_ckpt_export(const std::vector<std::string>& args);  // ckpt_export.cpp: `flowrun ckpt export ...`

}  // namespace flowrun::cli
