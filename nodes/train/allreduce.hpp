// The allreduce node's bucket plan, usable on its own (tests).
//
// A bucket is a run of consecutive positions of one group of a GradBuffer (train/grad_buffer.hpp),
// i.e. one contiguous slice of flats[group], reduced by one all-reduce in place. Positions follow
// the buffer's reverse module order, so the first buckets hold the last layers, whose gradients
// backward finishes first.
#pragma once
#include <cstdint>
#include <vector>

#include "train/grad_buffer.hpp"

namespace flowrun {

struct Bucket {
  int group = 0;       // flats[group]
  int64_t offset = 0;  // first element of the slice
  int64_t numel = 0;
  int64_t bytes = 0;
  int first = 0, end = 0;  // positions [first, end) in buffer order
};

struct BucketPlan {
  std::vector<Bucket> buckets;
  std::vector<int> bucket_of;  // per parameter (module order)

  // The layout the plan was made for, to tell whether another buffer has the same one.
  FlatLayout layout;
  bool fits(const GradBuffer& b) const;
};

// Buckets of at most `bucket_mb` MiB (the first of each group: at most `first_bucket_mb`, so the
// first all-reduce starts early, as DDP's bucket_size_limits do per dtype and device): a bucket is
// closed when adding the next parameter would exceed its cap, or at the end of a group; a
// parameter larger than the cap gets a bucket of its own. Over a gradient buffer's layout (reverse
// module order), or the buffer itself.
BucketPlan plan_buckets(const FlatLayout& layout, double first_bucket_mb, double bucket_mb);
BucketPlan plan_buckets(const GradBuffer& buffer, double first_bucket_mb, double bucket_mb);
// The buffer's layout (its slots, order and flats' dtypes, devices and sizes).
FlatLayout layout_of(const GradBuffer& buffer);

}  // namespace flowrun
