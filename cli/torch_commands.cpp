// libflowrun_cli_torch.so: the commands of the flowrun binary that need libtorch (torch_side.hpp
// says why they live apart): running a checked graph, `flowrun plan`, `flowrun prep`, `flowrun ckpt`
// (its export builds the graph: ckpt_export.cpp).
#include <cstdio>
#include <string>
#include <vector>

#include "commands.hpp"
#include "prep/prep.hpp"
#include "state/ckpt_command.hpp"
#include "run_session.hpp"
#include "torch_side.hpp"

extern "C" int flowrun_cli_torch_run(const flowrun::GraphSpec* g) {
  flowrun::RunSession session(g);
  if (auto end = session.start()) return *end;
  return session.close(session.run());
}

extern "C" int flowrun_cli_torch_command(const char* name, const std::vector<std::string>* args) {
  const std::string cmd = name;
  if (cmd == "plan") return flowrun::cli::cmd_plan(*args);
  if (cmd == "prep") return flowrun::prep_command(*args);
  if (cmd == "ckpt" && !args->empty() && (*args)[0] == "export")
    return flowrun::cli::cmd_ckpt_export({args->begin() + 1, args->end()});
  if (cmd == "ckpt") return flowrun::ckpt_command(*args);
  std::fprintf(stderr, "flowrun: no command '%s' in libflowrun_cli_torch.so\n", name);
  return 2;
}
