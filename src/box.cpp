#include "box.hpp"

#include <algorithm>

namespace ferry {

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

bool Box::operator<(const Box& o) const {
  if (offsets != o.offsets) return offsets < o.offsets;
  return sizes < o.sizes;
}

bool Box::contains(const Box& inner) const {
  if (inner.rank() != rank() || inner.offsets.size() != offsets.size()) return false;
  for (size_t i = 0; i < rank(); ++i) {
    if (inner.offsets[i] < offsets[i]) return false;
    if (inner.offsets[i] + inner.sizes[i] > offsets[i] + sizes[i]) return false;
  }
  return true;
}

std::string shape_to_string(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

std::string box_to_string(const int64_t* offsets, const int64_t* sizes, size_t rank) {
  // Half-open [start:end) per dimension, as a Python slice would print it.
  std::string s = "[";
  for (size_t i = 0; i < rank; ++i) {
    if (i) s += ", ";
    int64_t end = 0;
    if (__builtin_add_overflow(offsets[i], sizes[i], &end))
      s += std::to_string(offsets[i]) + ":" + std::to_string(offsets[i]) + "+" +
           std::to_string(sizes[i]);
    else
      s += std::to_string(offsets[i]) + ":" + std::to_string(end);
  }
  return s + "]";
}

std::string Box::to_string() const {
  return box_to_string(offsets.data(), sizes.data(), std::min(offsets.size(), sizes.size()));
}

Box Box::whole(const std::vector<int64_t>& shape) {
  return Box{std::vector<int64_t>(shape.size(), 0), shape};
}

std::optional<Box> intersect(const Box& a, const Box& b) {
  if (a.rank() != b.rank()) return std::nullopt;
  Box r;
  r.offsets.resize(a.rank());
  r.sizes.resize(a.rank());
  for (size_t i = 0; i < a.rank(); ++i) {
    int64_t lo = std::max(a.offsets[i], b.offsets[i]);
    int64_t hi = std::min(a.offsets[i] + a.sizes[i], b.offsets[i] + b.sizes[i]);
    if (hi <= lo) return std::nullopt;
    r.offsets[i] = lo;
    r.sizes[i] = hi - lo;
  }
  return r;
}

Box bounding_box(const Box& a, const Box& b) {
  if (a.rank() != b.rank()) return a;
  Box r = a;
  for (size_t i = 0; i < a.rank(); ++i) {
    r.offsets[i] = std::min(a.offsets[i], b.offsets[i]);
    r.sizes[i] = std::max(a.offsets[i] + a.sizes[i], b.offsets[i] + b.sizes[i]) - r.offsets[i];
  }
  return r;
}

void for_each_run(const Box& region, const Box& src, const Box& dst,
                  const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  RunCursor c(region, src, dst);
  for (c.seek(0); !c.done(); c.next()) fn(c.src(), c.dst(), c.run());
}

}  // namespace ferry
