// `flowrun prep text`: see prep_text.hpp. Two passes over the inputs, so memory stays at one
// file whatever the corpus size: the first counts documents (the val split is drawn from the
// count), the second tokenizes and writes each document to its split.
#include "prep/prep_text.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <stdexcept>

#include "formats/files.hpp"
#include "prep/cli_args.hpp"
#include "formats/indexed_dataset.hpp"
#include "data/shuffle.hpp"
#include "formats/tokenizer.hpp"

namespace fs = std::filesystem;

namespace flowrun {
namespace {

const char* kTextUsage =
    "usage: flowrun prep text --tokenizer byte|gpt2|TOKENIZER_JSON|MODEL_FOLDER [--vocab vocab.json --merges merges.txt]\n"
    "                         [--val-fraction 0.05] [--seed 1] [--split-on %] --out PREFIX FILE_OR_DIR...\n"
    "\n"
    "Tokenizes text files into token shards for the token_shards node:\n"
    "  PREFIX.train.{bin,idx}, PREFIX.val.{bin,idx}  Megatron indexed datasets, one sequence per document\n"
    "  PREFIX.json                                   tokenizer, vocab_size, documents and tokens per split\n"
    "\n"
    "  --tokenizer byte|gpt2   byte: id = byte (vocab 256); gpt2: GPT-2's BPE (vocab 50257, needs the two files)\n"
    "  --tokenizer PATH        a Hugging Face tokenizer.json, or a model folder holding one (Llama 3, Qwen 2/3);\n"
    "                          each document gets its post-processor's tokens (Llama 3: <|begin_of_text|>)\n"
    "  --vocab, --merges       GPT-2's vocab.json and merges.txt (scripts/data.sh puts them in data/gpt2/)\n"
    "  --val-fraction F        share of documents held out for val, chosen by a seeded shuffle (default 0.05)\n"
    "  --seed N                seed of that shuffle (default 1)\n"
    "  --split-on S            a line that is exactly S separates documents (fortune files: %);\n"
    "                          default: each file is one document\n"
    "  --out PREFIX            output prefix (folders are created)\n"
    "  FILE_OR_DIR...          text files; folders are read recursively (regular files, sorted, no hidden)\n"
    "\n"
    "gpt2 appends its end-of-text token (50256) to every document. Exit codes: 0 done, 2 bad usage\n"
    "or input, 1 a write failed.\n";


bool blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; });
}

// Calls fn(document) for each non-blank document of a file's text.
void for_each_document(std::string_view text, const std::optional<std::string>& split_on,
                       const std::function<void(std::string_view)>& fn) {
  if (!split_on) {
    if (!blank(text)) fn(text);
    return;
  }
  size_t doc_start = 0, pos = 0;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    const size_t next = eol == std::string_view::npos ? text.size() : eol + 1;
    std::string_view line = text.substr(pos, (eol == std::string_view::npos ? text.size() : eol) - pos);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line == *split_on) {
      std::string_view doc = text.substr(doc_start, pos - doc_start);
      if (!blank(doc)) fn(doc);
      doc_start = next;
    }
    pos = next;
  }
  std::string_view doc = text.substr(doc_start);
  if (!blank(doc)) fn(doc);
}

}  // namespace

// The largest document tokenized at once (its text and its ids are in memory together).
constexpr uint64_t kMaxDocumentBytes = uint64_t{1} << 30;

PrepTextSummary prep_text(const PrepTextOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  if (opt.out.empty()) throw std::invalid_argument("--out PREFIX is required");
  if (opt.inputs.empty()) throw std::invalid_argument("no input files given");
  if (!(opt.val_fraction >= 0 && opt.val_fraction < 1))
    throw std::invalid_argument("--val-fraction must be in [0, 1), got " + std::to_string(opt.val_fraction));
  if (opt.split_on && opt.split_on->empty()) throw std::invalid_argument("--split-on needs a non-empty separator line");
  std::unique_ptr<Tokenizer> tok;
  double load_seconds = 0;
  try {
    tok = make_tokenizer(opt.tokenizer, opt.vocab, opt.merges);
    load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } catch (const std::exception& e) {
    throw std::invalid_argument(e.what());
  }
  const std::vector<std::string> files = expand_input_files(opt.inputs);

  // The inputs are memory-mapped, never read whole (issue 47: a 5 GB file ended in a bare
  // std::bad_alloc). A document is tokenized in memory, so one without --split-on is bounded.
  auto text_of = [](const MappedFile& m) { return std::string_view(reinterpret_cast<const char*>(m.data()), m.size()); };
  for (const std::string& f : files) {
    std::error_code ec;
    const uint64_t size = fs::file_size(f, ec);
    if (!ec && !opt.split_on && size > kMaxDocumentBytes)
      throw std::invalid_argument(f + ": " + std::to_string(size >> 20) + " MiB as one document (no --split-on), more than the " +
                                  std::to_string(kMaxDocumentBytes >> 20) +
                                  " MiB one document may be; give --split-on SEPARATOR (the line between documents) or split the file");
  }

  // Pass 1: count documents, then choose the val ones.
  int64_t n_docs = 0;
  for (const std::string& f : files) {
    const std::unique_ptr<MappedFile> mapped = map_input_file(f);
    for_each_document(text_of(*mapped), opt.split_on, [&](std::string_view d) {
      if (d.size() > kMaxDocumentBytes)
        throw std::invalid_argument(f + ": a document of " + std::to_string(d.size() >> 20) + " MiB (document " +
                                    std::to_string(n_docs + 1) + "), more than the " + std::to_string(kMaxDocumentBytes >> 20) +
                                    " MiB one document may be; is --split-on the separator the file uses?");
      ++n_docs;
    });
  }
  if (n_docs == 0) throw std::invalid_argument("the inputs hold no documents (all empty or blank)");
  int64_t n_val = 0;
  if (opt.val_fraction > 0) {
    if (n_docs < 2)
      throw std::invalid_argument("only 1 document: nothing left to train on after holding out val (use --split-on, more files, "
                                  "or --val-fraction 0)");
    n_val = std::clamp<int64_t>(std::llround(opt.val_fraction * static_cast<double>(n_docs)), 1, n_docs - 1);
  }
  std::vector<bool> is_val(static_cast<size_t>(n_docs), false);
  const std::vector<int64_t> perm = seeded_permutation(n_docs, mix_seed({opt.seed, kSeedTagValSplit}));
  for (int64_t k = 0; k < n_val; ++k) is_val[static_cast<size_t>(perm[static_cast<size_t>(k)])] = true;

  // Pass 2: tokenize each document into its split.
  const fs::path parent = fs::path(opt.out).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    fs::create_directories(parent, ec);
    if (ec) throw std::runtime_error(parent.string() + ": cannot create: " + ec.message());
  }
  const TokenDtype dtype = dtype_for_vocab(tok->vocab_size());
  IndexedDatasetWriter train(opt.out + ".train", dtype), val(opt.out + ".val", dtype);
  PrepTextSummary s;
  s.files = static_cast<int64_t>(files.size());
  s.vocab_size = tok->vocab_size();
  std::vector<int32_t> ids;
  int64_t doc = 0;
  for (const std::string& f : files) {
    const std::unique_ptr<MappedFile> mapped = map_input_file(f);
    const std::string_view text = text_of(*mapped);
    s.bytes += static_cast<int64_t>(text.size());
    for_each_document(text, opt.split_on, [&](std::string_view d) {
      ids.clear();
      ids = tok->specials_before();
      const auto e0 = std::chrono::steady_clock::now();
      tok->encode(d, ids);
      s.encode_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - e0).count();
      ids.insert(ids.end(), tok->specials_after().begin(), tok->specials_after().end());
      if (auto eot = tok->eot(); eot && (ids.empty() || ids.back() != *eot)) ids.push_back(*eot);
      (is_val[static_cast<size_t>(doc++)] ? val : train).add_document(ids);
    });
  }
  train.finish();
  val.finish();
  s.documents[0] = train.documents(), s.documents[1] = val.documents();
  s.tokens[0] = train.tokens(), s.tokens[1] = val.tokens();

  nlohmann::json j;
  j["tokenizer"] = tok->name();
  if (opt.tokenizer != "byte" && opt.tokenizer != "gpt2") j["tokenizer_path"] = opt.tokenizer;
  j["vocab_size"] = tok->vocab_size();
  j["eot"] = tok->eot() ? nlohmann::json(*tok->eot()) : nlohmann::json(nullptr);
  j["dtype"] = dtype_name(dtype);
  j["documents"] = s.documents[0] + s.documents[1];
  j["tokens"] = s.tokens[0] + s.tokens[1];
  j["splits"] = {{"train", {{"documents", s.documents[0]}, {"tokens", s.tokens[0]}}},
                 {"val", {{"documents", s.documents[1]}, {"tokens", s.tokens[1]}}}};
  j["seed"] = opt.seed;
  j["val_fraction"] = opt.val_fraction;
  j["split_on"] = opt.split_on ? nlohmann::json(*opt.split_on) : nlohmann::json(nullptr);
  j["files"] = s.files;
  write_file_atomic(opt.out + ".json", j.dump(2) + "\n");
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  s.load_seconds = load_seconds;
  return s;
}

int prep_text_command(const std::vector<std::string>& args) {
  PrepTextOptions opt;
  bool have_tokenizer = false;
  return run_cli_command("prep text", kTextUsage, args, [&](const CliArgs& cl) {
    opt.inputs = cl.positional;
    for (const auto& [a, v] : cl.options) {
      if (a == "--tokenizer") {
        opt.tokenizer = v, have_tokenizer = true;
      } else if (a == "--vocab") {
        opt.vocab = v;
      } else if (a == "--merges") {
        opt.merges = v;
      } else if (a == "--val-fraction") {
        opt.val_fraction = cli_number(a, v);
      } else if (a == "--seed") {
        opt.seed = cli_uint(a, v);
      } else if (a == "--split-on") {
        opt.split_on = v;
      } else if (a == "--out") {
        opt.out = v;
      } else {
        throw std::invalid_argument("unknown option " + a);
      }
    }
    if (!have_tokenizer) throw std::invalid_argument("--tokenizer byte|gpt2|TOKENIZER_JSON|MODEL_FOLDER is required");
    if (opt.tokenizer == "gpt2" && (opt.vocab.empty() || opt.merges.empty()))
      throw std::invalid_argument("--tokenizer gpt2 needs --vocab vocab.json and --merges merges.txt (scripts/data.sh puts them in data/gpt2/)");
    if (opt.tokenizer != "gpt2" && (!opt.vocab.empty() || !opt.merges.empty()))
      throw std::invalid_argument("--vocab/--merges are for --tokenizer gpt2 only");

    const PrepTextSummary s = prep_text(opt);
    std::printf("prep text: %lld files, %.1f MB -> %lld documents; tokenizer %s (vocab %lld); %.2f s (loading the tokenizer %.2f s, "
                "encoding %.2f s: %.1f MB/s)\n",
                static_cast<long long>(s.files), s.bytes / 1e6, static_cast<long long>(s.documents[0] + s.documents[1]),
                opt.tokenizer.c_str(), static_cast<long long>(s.vocab_size), s.seconds, s.load_seconds, s.encode_seconds,
                s.bytes / 1e6 / std::max(s.encode_seconds, 1e-9));
    const char* names[2] = {"train", "val"};
    for (int k = 0; k < 2; ++k)
      std::printf("  %s.%s.{bin,idx}: %lld documents, %lld tokens\n", opt.out.c_str(), names[k],
                  static_cast<long long>(s.documents[k]), static_cast<long long>(s.tokens[k]));
    std::printf("  %s.json\n", opt.out.c_str());
    return 0;
  });
}

}  // namespace flowrun
