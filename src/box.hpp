// N-dimensional boxes (offsets + sizes) in a tensor's global index space, and
// the row-major byte arithmetic that resharding is built on.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ferry/tensor.hpp"

namespace ferry {

struct Box {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;

  size_t rank() const { return sizes.size(); }
  int64_t numel() const;  // 1 for a 0-d box
  bool empty() const { return numel() == 0; }
  bool operator==(const Box& o) const { return offsets == o.offsets && sizes == o.sizes; }
  bool operator!=(const Box& o) const { return !(*this == o); }
  bool operator<(const Box& o) const;  // lexicographic on offsets, then sizes
  bool contains(const Box& inner) const;
  std::string to_string() const;  // "[0:4096, 0:128]"

  static Box whole(const std::vector<int64_t>& shape);
};

// shape_to_string, how every message spells a shape, is public (ferry/tensor.hpp).
// How every message spells a box, "[0:4096, 0:128]" (Python slices), from
// flat arrays as the planner keeps them. Safe on hostile input: an end that
// would overflow is printed as "offset+size".
std::string box_to_string(const int64_t* offsets, const int64_t* sizes, size_t rank);

// The common part of two boxes of the same rank, or nullopt when it is empty.
std::optional<Box> intersect(const Box& a, const Box& b);

// The smallest box holding both (of the same rank; else `a`).
Box bounding_box(const Box& a, const Box& b);

// The runs of for_each_run(region, src, dst), addressable by index. A read
// holds a slice of a chunk; seeking straight to its first run keeps copying a
// chunk split into many reads linear in the runs instead of reads x runs.
class RunCursor {
 public:
  RunCursor(const Box& region, const Box& src, const Box& dst) : sizes_(region.sizes) {
    const size_t r = region.rank();
    if (region.empty()) {
      count_ = 0;
      return;
    }
    inner_ = r == 0 ? 0 : r - 1;
    while (inner_ > 0 && region.sizes[inner_] == src.sizes[inner_] &&
           region.sizes[inner_] == dst.sizes[inner_])
      --inner_;
    for (size_t k = inner_; k < r; ++k) run_ *= region.sizes[k];
    src_stride_.resize(r);
    dst_stride_.resize(r);
    int64_t sa = 1, da = 1;
    for (size_t k = r; k-- > 0;) {
      src_stride_[k] = sa;
      dst_stride_[k] = da;
      sa *= src.sizes[k];
      da *= dst.sizes[k];
    }
    for (size_t k = 0; k < r; ++k) {
      src_base_ += (region.offsets[k] - src.offsets[k]) * src_stride_[k];
      dst_base_ += (region.offsets[k] - dst.offsets[k]) * dst_stride_[k];
    }
    count_ = 1;
    for (size_t k = 0; k < inner_; ++k) count_ *= region.sizes[k];
    idx_.assign(inner_, 0);
  }

  int64_t count() const { return count_; }
  int64_t run() const { return run_; }

  // Source element offset of run i, without moving the cursor.
  int64_t src_of(int64_t i) const {
    int64_t s = src_base_;
    for (size_t k = inner_; k-- > 0;) {
      s += (i % sizes_[k]) * src_stride_[k];
      i /= sizes_[k];
    }
    return s;
  }

  void seek(int64_t i) {
    pos_ = i;
    src_ = src_base_;
    dst_ = dst_base_;
    for (size_t k = inner_; k-- > 0;) {
      idx_[k] = i % sizes_[k];
      i /= sizes_[k];
      src_ += idx_[k] * src_stride_[k];
      dst_ += idx_[k] * dst_stride_[k];
    }
  }

  bool done() const { return pos_ >= count_; }
  int64_t src() const { return src_; }
  int64_t dst() const { return dst_; }

  void next() {
    ++pos_;
    for (size_t k = inner_; k-- > 0;) {
      if (++idx_[k] < sizes_[k]) {
        src_ += src_stride_[k];
        dst_ += dst_stride_[k];
        return;
      }
      src_ -= (sizes_[k] - 1) * src_stride_[k];
      dst_ -= (sizes_[k] - 1) * dst_stride_[k];
      idx_[k] = 0;
    }
  }

 private:
  std::vector<int64_t> sizes_;
  std::vector<int64_t> src_stride_, dst_stride_;
  std::vector<int64_t> idx_;
  size_t inner_ = 0;
  int64_t run_ = 1;
  int64_t count_ = 0;
  int64_t src_base_ = 0, dst_base_ = 0;
  int64_t pos_ = 0, src_ = 0, dst_ = 0;
};

// Calls fn(src_elem, dst_elem, n_elems) for every maximal contiguous run of
// `region` (which must lie inside both `src` and `dst`), in row-major order,
// where src_elem/dst_elem are the run's element offsets in the row-major
// linearization of src and dst. Runs that are contiguous in both are merged.
void for_each_run(const Box& region, const Box& src, const Box& dst,
                  const std::function<void(int64_t, int64_t, int64_t)>& fn);

}  // namespace ferry
