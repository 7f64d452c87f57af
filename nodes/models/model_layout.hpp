// ModelLayout: how a model's tensors lie over the ranks of a parallel run, one part of its
// ModelState (models/model_state.hpp): the tensor-parallel parts, the pipeline stages, the ZeRO-3
// shards, and what an export gathers whole from them. A model of one process leaves every
// field null: its module holds every tensor whole.
//
// Who sets what: the family's model node sets `tp`, `splits_over_tp`, `vocab_split_logits`,
// `tied` and `stages` at setup from its declaration (models/family.hpp hold_declared); the optimizer sets `shards` at its setup under the zero
// node's stage params (train/fully_sharded.hpp); the checkpoint's collect (model_state.cpp,
// collective over the checkpoint's own channels) fills `gathered` under exports: true, which the
// exporters write (a checkpoint's own files are each rank's pieces, never gathered).
#pragma once
#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "models/param_use.hpp"
#include "models/stages.hpp"

namespace flowrun {

struct ModelState;

namespace parallel {
struct TpLayout;  // parallel/tensor_parallel.hpp
class Group;      // parallel/collectives.hpp
}  // namespace parallel

struct ModelLayout {
  // Tensor parallel (run.parallel.tp > 1): the module holds this rank's parts of the split
  // tensors, laid out as `tp` says (its group: this rank's place among the tp ranks). A
  // checkpoint writes this rank's parts as boxes of the whole tensors and a load (resume) reads
  // them back at any layout (model_state.cpp); exports are whole: under exports: true the
  // checkpoint's collect gathers them into `gathered` on rank 0, which the exporters write
  // (lora::peft_files); the start-up broadcast leaves the parts alone. Null: the module is whole.
  std::shared_ptr<const parallel::TpLayout> tp;
  std::map<std::string, torch::Tensor> gathered;
  // Whether tensor parallel splits a parameter (by name), set by a family that splits at any tp:
  // what forward_backward's memory advice counts as the share a larger tp would divide. Null: the
  // model does not split.
  std::function<bool(const std::string& param)> splits_over_tp;
  // What the forward returns under tensor parallel, said by the model rather than guessed by its
  // objective: true when a language model's logits are this rank's columns of the vocabulary
  // (GPT's head tied to its split token table), which the lm objective scores with the
  // vocabulary-parallel cross-entropy; false: whole on every rank, scored whole.
  bool vocab_split_logits = false;
  // A mixture of experts (its family's Family::experts): whether a parameter is an expert's (split
  // over run.parallel.ep, whole over tp), how many experts a sparse layer has and how many each
  // token goes to: what the planner counts (the experts' memory / ep, the all-to-alls' bytes).
  // Null, 0: no experts.
  std::function<bool(const std::string& param)> is_expert;
  int64_t experts = 0, top_k = 0;
  // Parameters the model uses twice, by name (a head tied to its token table: GPT's wte, a tied
  // Llama's embed_tokens), from its family's declaration (models/family.hpp): the planner counts
  // the head's products on them.
  std::vector<std::string> tied;

  // Pipeline parallel (run.parallel.pp > 1; models/stages.hpp): the module holds this rank's
  // chunks of the model only, named as in the whole model; a checkpoint writes each stage's
  // tensors from that stage's ranks, and a load reads the names this rank holds. Null: the module
  // is every stage.
  std::shared_ptr<const Stages> stages;

  // ZeRO stage 3 (the zero node's stage: params; train/fully_sharded.hpp, set up by the
  // optimizer): the trainable parameters sharded over the data-parallel ranks. Between uses each
  // holds no data and this rank keeps its slice; a node that runs the model opens a ParamUse
  // (models/param_use.hpp) for as long as it does. Null: the module holds its parameters.
  struct Shards {
    virtual ~Shards() = default;
    // A use over `group` (this node's channel over the data-parallel ranks; null with one).
    virtual std::unique_ptr<ParamUse> open(parallel::Group* group, const std::string& what) = 0;
    // Every trainable parameter whole, by name: collective over `group` (an exports: true
    // checkpoint's).
    virtual std::map<std::string, torch::Tensor> wholes(parallel::Group& group) = 0;
    // Whole values in by name, this rank keeping its slice; returns the ones not its own (buffers).
    virtual std::map<std::string, torch::Tensor> load(const std::map<std::string, torch::Tensor>& whole) = 0;
    // A copy of the module with every parameter let go, made from one taken when it was sharded
    // (never from the module in use), and the same layout over the copy's parameters with the
    // slices copied: what clone() makes (the EMA's copy, a reader's).
    virtual std::shared_ptr<torch::nn::Module> fresh_module() const = 0;
    virtual std::shared_ptr<Shards> copy_for(ModelState& copy) const = 0;
    // This rank's slice of each flat buffer (what an average combines, slice by slice).
    virtual std::vector<torch::Tensor>& slices() = 0;
    // The same as ranges of the parameters (what a per-rank checkpoint writes and reads, in
    // place): parameter `name`, of `shape` (this rank's tp part under tp), holds its row-major
    // elements [offset, offset + data.numel()) in `data`, a 1-D view of a slice.
    struct Range {
      std::string name;
      std::vector<int64_t> shape;
      int64_t offset = 0;
      torch::Tensor data;
    };
    virtual std::vector<Range> ranges() = 0;
  };
  std::shared_ptr<Shards> shards;
};

}  // namespace flowrun
