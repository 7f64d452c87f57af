// `flowrun ckpt ...`: checkpoints outside a run (formats/checkpoint_io.hpp's folders, any version).
//   flowrun ckpt list DIR                 the step folders of DIR (a checkpoints/ folder or a run's
//                                         out_dir): step, complete or why not, who wrote it
//   flowrun ckpt verify FOLDER|DIR        every file read whole against its size and CRC32C
//   flowrun ckpt consolidate FOLDER OUT   one process's checkpoint in OUT (a file per state, its
//                                         tensors whole), which a run of one process resumes from
//   flowrun ckpt consolidate FOLDER OUT.safetensors --state REF
//                                         one state's tensors whole in one safetensors file
//   flowrun ckpt export GRAPH FOLDER OUT  the models as Hugging Face / PEFT folders (cli/ckpt_export.cpp:
//                                         it builds the graph, so it lives above the nodes)
// As PyTorch's dcp_to_torch_save. Torch-free interface: cli/ includes it.
#pragma once
#include <string>
#include <vector>

namespace flowrun {

// args: what follows "ckpt". Exit code: 0 done (verify: every file matches), 1 damaged or a failure
// while writing, 2 bad usage or no such checkpoint.
int ckpt_command(const std::vector<std::string>& args);

// The step folder PATH names: PATH itself when it is one (a manifest.json, or named step_*), else
// the folder `latest` names in PATH or PATH/checkpoints. Throws std::invalid_argument otherwise.
std::string ckpt_step_folder(const std::string& path);

}  // namespace flowrun
