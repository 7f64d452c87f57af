// flowrun: run training graphs written in YAML.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cli/commands.hpp"
#include "comm.hpp"
#include "data/prep.hpp"
#include "log.hpp"

static const char* kUsage =
    "usage: flowrun [run] FILE [KEY=VALUE...] [--print-config]   run a graph (overrides: run.steps=50, opt.lr=1e-3)\n"
    "       flowrun validate FILE...                            check graph files, report every error, run nothing\n"
    "       flowrun dot FILE [KEY=VALUE...]                     the graph as Graphviz dot\n"
    "       flowrun nodes [TYPE] [--plugin LIB.so]              list node types, or one type's ports and parameters\n"
    "       flowrun prep text --tokenizer byte|gpt2 --out PREFIX FILE_OR_DIR...   token shards from text files\n"
    "       flowrun COMMAND --help                              help for one command\n"
    "\n"
    "environment: FLOWRUN_PLUGIN_PATH (':'-separated plugin files or folders), FLOWRUN_LOG (debug, info, warn)\n"
    "exit codes: 0 ok, 1 a node failed, 2 invalid graph file or usage, 130 stopped by Ctrl-C\n";

// OpenMP threads (tensor math) spin while idle by default; with TBB workers and a data reader
// sharing the cores that spinning made a training step up to 12x slower here. The OpenMP
// runtime reads OMP_WAIT_POLICY when it is loaded, before main(), so set it and start again.
static void passive_openmp(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY")) return;
  setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  execv("/proc/self/exe", argv);  // on failure, carry on as we are
}

static int dispatch(const std::vector<std::string>& args);

int main(int argc, char** argv) {
  passive_openmp(argv);
  std::vector<std::string> args(argv + 1, argv + argc);
  flowrun::setup_logging(0, 1);
  // Under mpirun/srun: join the MPI world (every log line then carries the rank).
  try {
    flowrun::comm::init(&argc, &argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flowrun: %s\n", e.what());
    return 2;
  }
  flowrun::setup_logging(flowrun::comm::rank(), flowrun::comm::size());
  const int rc = dispatch(args);
  // A rank that fails alone would leave the others waiting in their next collective: end the
  // whole job (node failures already did this the moment they happened, see cmd_run).
  if (rc != 0 && flowrun::comm::distributed())
    flowrun::comm::abort_job(flowrun::comm::where() + ": flowrun exited with code " + std::to_string(rc), rc);
  flowrun::comm::finalize();
  return rc;
}

static int dispatch(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "--version") {
    std::puts("flowrun 0.1.0");
    return 0;
  }
  const std::string cmd = args[0];
  std::vector<std::string> rest(args.begin() + 1, args.end());
  if (cmd == "run") return flowrun::cli::cmd_run(rest);
  if (cmd == "validate") return flowrun::cli::cmd_validate(rest);
  if (cmd == "dot") return flowrun::cli::cmd_dot(rest);
  if (cmd == "nodes") return flowrun::cli::cmd_nodes(rest);
  if (cmd == "prep") return flowrun::prep_command(rest);
  if (cmd.size() > 5 && (cmd.rfind(".yaml") == cmd.size() - 5 || cmd.rfind(".yml") == cmd.size() - 4))
    return flowrun::cli::cmd_run(args);
  if (cmd.find('/') != std::string::npos || cmd.find('.') != std::string::npos) return flowrun::cli::cmd_run(args);
  std::fprintf(stderr, "flowrun: unknown command '%s'\n\n%s", cmd.c_str(), kUsage);
  return 2;
}
