// The torch side of the flowrun command. Running a graph, `flowrun plan` and `flowrun prep` need
// libtorch, whose start-up (its static initialisation: 0.3-0.9 s, by the CPU) the commands that
// only read a graph file (--help, validate, dot, explain, nodes) must not pay. So the flowrun
// binary links no libtorch; those commands live in libflowrun_cli_torch.so beside it
// (cli/torch_commands.cpp), opened (dlopen) the first time one is asked for.
#pragma once
#include <string>
#include <vector>

namespace flowrun {
struct GraphSpec;
}

namespace flowrun::cli {

// Runs a loaded graph (null: this rank's file failed to load; it still joins the job, as
// session/run_session.hpp says). Returns the exit code.
int run_graph(const GraphSpec* g);

// `flowrun plan ...` and `flowrun prep ...`: name is "plan" or "prep", args what follows it.
int torch_command(const std::string& name, const std::vector<std::string>& args);

}  // namespace flowrun::cli

// The library's entry points, resolved by name (extern "C": no mangling to agree on).
extern "C" int flowrun_cli_torch_run(const flowrun::GraphSpec* g);
extern "C" int flowrun_cli_torch_command(const char* name, const std::vector<std::string>* args);
