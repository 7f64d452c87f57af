// `flowrun prep KIND ...`: make training data files from raw inputs. Torch-free on purpose:
// cli/main.cpp includes it.
//   flowrun prep text ...   token shards (Megatron .bin/.idx) from text files: prep_text.hpp
//   flowrun prep images ... WebDataset tar shards from image + caption pairs: prep_images.hpp
//   flowrun prep arrow ...  HunyuanDiT's Arrow files + an IndexKits Index V2 from them: prep_arrow.hpp
//   flowrun prep shapes ... the DiT demo's colored-shapes image-text set (data/shapes.hpp):
//                           prep_shapes.cpp
#pragma once
#include <string>
#include <vector>

namespace flowrun {

// args: what follows "prep" on the command line. Prints help or a summary; returns the exit
// code: 0 done, 2 bad usage or unusable input (missing files, bad options), 1 a failure while
// writing.
int prep_command(const std::vector<std::string>& args);

// `flowrun prep shapes ...` (args after "shapes"). Exit code: 0, 2 bad usage, 1 write failure.
int prep_shapes_command(const std::vector<std::string>& args);

}  // namespace flowrun
