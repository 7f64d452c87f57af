// load_by_name (models/load_by_name.hpp): the one loader every model's weights go through
// (gpt, dit, lora adapters, bert, t5_encoder, vae). A file either loads whole or not at all,
// and a bad one is one error that lists every problem.
#include <gtest/gtest.h>

#include "models/load_by_name.hpp"

namespace flowrun {
namespace {

// A module with two parameters and a buffer: "lin.weight" [2, 3], "lin.bias" [2], "scale" [1].
struct Tiny : torch::nn::Module {
  Tiny() {
    lin = register_module("lin", torch::nn::Linear(3, 2));
    scale = register_buffer("scale", torch::ones({1}));
  }
  torch::nn::Linear lin{nullptr};
  torch::Tensor scale;
};

// A complete file for Tiny, names behind `prefix`.
NamedTensorMap tiny_file(const std::string& prefix = "") {
  return {{prefix + "lin.weight", torch::full({2, 3}, 2.0)},
          {prefix + "lin.bias", torch::full({2}, 3.0)},
          {prefix + "scale", torch::full({1}, 4.0)}};
}

TEST(LoadByName, CopiesEveryParameterAndBufferByNameConvertingTheDtype) {
  Tiny m;
  NamedTensorMap f = tiny_file("model.");
  f["lin.weight"] = f["model.lin.weight"].to(torch::kBFloat16);  // without the prefix, in bf16
  f.erase("model.lin.weight");
  LoadByNameOptions o;
  o.model = "tiny";
  o.prefixes = {"model."};
  load_by_name(m, f, "t.safetensors", o);
  EXPECT_TRUE(torch::equal(m.lin->weight, torch::full({2, 3}, 2.0)));
  EXPECT_EQ(m.lin->weight.scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::equal(m.lin->bias, torch::full({2}, 3.0)));
  EXPECT_TRUE(torch::equal(m.scale, torch::full({1}, 4.0)));
}

TEST(LoadByName, EveryProblemIsListedInOneErrorAndNothingIsCopied) {
  Tiny m;
  const torch::Tensor before = m.lin->weight.detach().clone();
  NamedTensorMap f = tiny_file();
  f.erase("lin.bias");                          // missing
  f["lin.weight"] = torch::zeros({3, 2});       // mis-shaped
  f["extra"] = torch::zeros({5});               // unexpected
  f["scale"] = torch::ones({1}, torch::kLong);  // not a float type
  LoadByNameOptions o;
  o.model = "tiny (in=3 out=2)";
  o.describe_file = [](const NamedTensorMap& file) { return "the file has " + std::to_string(file.size()) + " tensors"; };
  try {
    load_by_name(m, f, "bad.safetensors", o);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()),
              "bad.safetensors: cannot load into tiny (in=3 out=2): 1 missing, 1 unexpected, 2 mis-shaped tensor(s)\n"
              "  missing: lin.bias [2]\n"
              "  unexpected: extra [5]\n"
              "  mis-shaped: lin.weight: [3, 2] in the file, the model's is [2, 3]\n"
              "  mis-shaped: scale: dtype Long is not a float type\n"
              "  (the file has 3 tensors)");
  }
  EXPECT_TRUE(torch::equal(m.lin->weight, before));  // all or nothing
}

// Issue 47: NaN weights or adapters loaded silently, and step 1 blamed the learning rate.
TEST(LoadByName, NonFiniteValuesAreRefusedNamingTheTensor) {
  Tiny m;
  NamedTensorMap f = tiny_file();
  f["lin.bias"] = f["lin.bias"].clone();
  f["lin.bias"][1] = NAN;
  LoadByNameOptions o;
  o.model = "tiny";
  try {
    load_by_name(m, f, "nan.safetensors", o);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()),
              "nan.safetensors: cannot load into tiny: 0 missing, 0 unexpected, 0 mis-shaped, 1 non-finite tensor(s)\n"
              "  holds NaN or infinite values: lin.bias [2]");
  }
}

TEST(LoadByName, RenamesIgnoresOptionalNamesAndExtraChecks) {
  Tiny m;
  NamedTensorMap f = {{"lin.weight.default", torch::full({2, 3}, 1.0)},  // renamed
                      {"lin.bias", torch::full({2}, 1.0)},
                      {"pooler.dense", torch::zeros({7})}};  // ignored
  LoadByNameOptions o;
  o.model = "tiny";
  o.rename = [](const std::string& k) { return k == "lin.weight.default" ? std::string("lin.weight") : k; };
  o.ignore = [](const std::string& k) { return k.rfind("pooler.", 0) == 0; };
  o.optional = [](const std::string& k) { return k == "scale"; };  // keeps its value
  load_by_name(m, f, "f", o);
  EXPECT_TRUE(torch::equal(m.lin->weight, torch::full({2, 3}, 1.0)));
  EXPECT_TRUE(torch::equal(m.scale, torch::ones({1})));

  o.check = [](const NamedTensorMap& file) {
    return file.count("lin.bias") ? std::vector<std::string>{"lin.bias: this model wants no bias"}
                                  : std::vector<std::string>{};
  };
  try {
    load_by_name(m, f, "f", o);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("1 mis-shaped tensor(s)\n  mis-shaped: lin.bias: this model wants no bias"),
              std::string::npos)
        << e.what();
  }
}

TEST(LoadByName, ANameUnderTwoSpellingsIsUnexpected) {
  Tiny m;
  NamedTensorMap f = tiny_file();
  f["model.lin.bias"] = torch::full({2}, 9.0);  // the same tensor again, with the prefix
  LoadByNameOptions o;
  o.model = "tiny";
  o.prefixes = {"model."};
  try {
    load_by_name(m, f, "f", o);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("unexpected: model.lin.bias [2] (given twice, under two names)"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace flowrun
