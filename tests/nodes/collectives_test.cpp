// The one collective interface (nodes/parallel/collectives.hpp) in a single process: a group of
// one, whose collectives leave every tensor as the sums over one rank are (the multi-process
// cases: tests/mpi mesh_groups; CUDA tensors over NCCL: tests/gpu).
#include <gtest/gtest.h>

#include "parallel/collectives.hpp"
#include "parallel/mesh.hpp"
#include "parallel/tensor_parallel.hpp"

using flowrun::parallel::Group;

TEST(Collectives, AGroupOfOneLeavesEveryTensorAsItIs) {
  auto g = Group::world("solo");
  EXPECT_EQ(g->size(), 1);
  EXPECT_EQ(g->rank(), 0);
  torch::Tensor t = torch::arange(5, torch::kFloat);
  g->all_reduce(t, flowrun::comm::Op::sum, "sum").wait();
  EXPECT_TRUE(torch::equal(t, torch::arange(5, torch::kFloat)));
  torch::Tensor recv = torch::full({5}, -1.0, torch::kDouble);
  g->reduce_scatter(torch::arange(5, torch::kDouble), recv, {5}, "reduce-scatter").wait();
  EXPECT_TRUE(torch::equal(recv, torch::arange(5, torch::kDouble)));
  torch::Tensor blocks = torch::arange(4, torch::kBFloat16);
  g->all_gather(blocks, {4}, "all-gather").wait();
  EXPECT_TRUE(torch::equal(blocks, torch::arange(4, torch::kBFloat16)));
  torch::Tensor flags = torch::tensor({0, 1, 1}, torch::kByte);
  {  // a Work of a group of one is done at once
    flowrun::parallel::Work w = g->all_reduce(flags, flowrun::comm::Op::max, "flags");
    EXPECT_TRUE(w.done());
    w.wait();
    w.check();
  }
  EXPECT_TRUE(torch::equal(flags, torch::tensor({0, 1, 1}, torch::kByte)));
}

TEST(Collectives, WhatCannotGoBetweenRanksIsRefusedNamingIt) {
  auto g = Group::world("solo");
  try {
    g->all_reduce(torch::zeros({2}, torch::kInt), flowrun::comm::Op::sum, "node 'x' (y): counts");
    FAIL() << "int32 was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("node 'x' (y): counts: cannot send Int tensors between ranks"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(g->all_reduce(torch::zeros({4, 4}).t(), flowrun::comm::Op::sum, "transposed"), std::logic_error);
  EXPECT_THROW(g->reduce_scatter(torch::zeros({2}), torch::zeros({2}, torch::kDouble), {2}, "mixed"), std::logic_error);
}

TEST(Collectives, APointToPointMessageNeedsAnotherRankOfTheGroup) {
  auto g = Group::world("solo");
  try {
    g->send(torch::zeros({2}), 0, "node 'stage0' (pipeline): activations of micro-batch 1");
    FAIL() << "a send to itself was accepted";
  } catch (const flowrun::comm::CommError& e) {
    EXPECT_NE(std::string(e.what()).find("'solo': node 'stage0' (pipeline): activations of micro-batch 1: rank 0 is "
                                         "not another rank of this group of 1 (this one is rank 0)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(g->recv(torch::zeros({2}), 1, "gradients"), flowrun::comm::CommError);
}

// Issue 69 §3: a split model holds its place among the tp ranks, not a channel; its collectives
// run on the channel of the node running it (parallel::TpChannel over the node's own group, which
// its schema declares), so a split layer run outside any node's channel fails naming the group.
TEST(Collectives, AModelsPlaceAmongTheRanksIsNoChannel) {
  const uint64_t channels = flowrun::comm::Channel::created();
  auto place = Group::place("model", flowrun::parallel::Mesh(4, 2, 1), flowrun::parallel::Dim::tp, 3);
  EXPECT_EQ(flowrun::comm::Channel::created(), channels);  // nothing was created
  EXPECT_EQ(place->name(), "model (tp)");
  EXPECT_EQ(place->rank(), 1);
  EXPECT_EQ(place->size(), 2);
  try {
    flowrun::parallel::reduce_from_tp(torch::ones({2}), place);
    FAIL() << "a collective on a place was accepted";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("'model (tp)' is a place among the ranks, not a channel"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(place->send(torch::zeros({2}), 0, "activations"), std::logic_error);
  // A node's channel over the same ranks carries them (here a group of one stands in for it).
  auto own = Group::world("fb");
  {
    const flowrun::parallel::TpChannel open(own.get());
    EXPECT_THROW(flowrun::parallel::reduce_from_tp(torch::ones({2}), place), std::logic_error)
        << "a channel over other ranks than the model's is refused";
  }
}
