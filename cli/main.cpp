// flowrun: run training graphs written in YAML. This binary links no libtorch: the commands that
// read graph files (commands.cpp) answer at once, and the ones that train or make data open the
// library that has them (torch_side.hpp).
#include <malloc.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "commands.hpp"
#include "comm.hpp"
#include "log.hpp"
#include "torch_side.hpp"

static const char* kUsage =
    "usage: flowrun [run] FILE [KEY=VALUE...] [--print-config]   run a graph (overrides: run.steps=50, opt.lr=1e-3)\n"
    "       flowrun validate FILE...                            check graph files, report every error, run nothing\n"
    "       flowrun dot [--trace TRACE] FILE [KEY=VALUE...]     the graph as Graphviz dot (with a run's measured times)\n"
    "       flowrun explain FILE [KEY=VALUE...]                 one step as the program it runs: order, streams, waits\n"
    "       flowrun plan FILE [KEY=VALUE...] --devices N        the fastest layout of N devices that fits, from a profile\n"
    "       flowrun nodes [TYPE] [--plugin LIB.so]              list node types, or one type's ports and parameters\n"
    "       flowrun prep text --tokenizer byte|gpt2 --out PREFIX FILE_OR_DIR...   token shards from text files\n"
    "       flowrun ckpt list|verify|consolidate|export ...     checkpoints: list, check, make one file or HF/PEFT folders\n"
    "       flowrun COMMAND --help                              help for one command\n"
    "\n"
    "where the time goes: run.profile=true (a table per node at the end), run.trace=FILE (Chrome trace),\n"
    "                     NODE.tensorboard=true (metrics to TensorBoard); flowrun run --help\n"
    "environment: FLOWRUN_PLUGIN_PATH (':'-separated plugin files or folders), FLOWRUN_LOG (a level: debug, info, warn, ...; json: one JSON object per log line)\n"
    "exit codes: 0 ok, 1 a node failed, 2 invalid graph file, usage or out_dir in use,\n"
    "            128 + signal when stopped by one: 130 Ctrl-C, 143 SIGTERM, 138 SIGUSR1, 129 SIGHUP\n";

// A training step frees its activations and allocates them again the next step. glibc hands
// large blocks back to the kernel (blocks over the mmap threshold, and the top of the heap once
// more than the trim threshold is free), and the next step page-faults them back in, zeroed:
// 12 % of a GPT bench step here. Keep them in the process instead: blocks up to 32 MB (glibc's
// maximum threshold) come from the heap, and the heap is not trimmed; so the resident size stays
// at the run's peak. MALLOC_* / GLIBC_TUNABLES in the environment still decide where given.
static void keep_freed_memory() {
  if (std::getenv("GLIBC_TUNABLES") || std::getenv("MALLOC_MMAP_THRESHOLD_") || std::getenv("MALLOC_TRIM_THRESHOLD_"))
    return;
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
}

static int dispatch(const std::vector<std::string>& args);

int main(int argc, char** argv) {
  keep_freed_memory();
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    flowrun::setup_logging(0, 1);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flowrun: %s\n", e.what());
    return 2;
  }
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
  // whole job (node failures already did this the moment they happened: session/run_session.cpp).
  // A stop by signal (128 + signal) is agreed by every rank: they finalize normally.
  if (rc != 0 && rc < 128 && flowrun::comm::distributed())
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
  if (cmd == "explain") return flowrun::cli::cmd_explain(rest);
  if (cmd == "nodes") return flowrun::cli::cmd_nodes(rest);
  // These two need libtorch: torch_side.hpp opens the library that has them.
  if (cmd == "plan" || cmd == "prep" || cmd == "ckpt") return flowrun::cli::torch_command(cmd, rest);
  if (cmd.size() > 5 && (cmd.rfind(".yaml") == cmd.size() - 5 || cmd.rfind(".yml") == cmd.size() - 4))
    return flowrun::cli::cmd_run(args);
  if (cmd.find('/') != std::string::npos || cmd.find('.') != std::string::npos) return flowrun::cli::cmd_run(args);
  std::fprintf(stderr, "flowrun: unknown command '%s'\n\n%s", cmd.c_str(), kUsage);
  return 2;
}
