// N-dimensional boxes (offsets + sizes) in a tensor's global index space, and
// the row-major byte arithmetic that resharding is built on.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

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

// The common part of two boxes of the same rank, or nullopt when it is empty.
std::optional<Box> intersect(const Box& a, const Box& b);

// Calls fn(src_elem, dst_elem, n_elems) for every maximal contiguous run of
// `region` (which must lie inside both `src` and `dst`), in row-major order,
// where src_elem/dst_elem are the run's element offsets in the row-major
// linearization of src and dst. Runs that are contiguous in both are merged.
void for_each_run(const Box& region, const Box& src, const Box& dst,
                  const std::function<void(int64_t, int64_t, int64_t)>& fn);

}  // namespace ferry
