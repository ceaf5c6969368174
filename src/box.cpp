#include "ferry/box.hpp"

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

std::string Box::to_string() const {
  // Half-open [start:end) per dimension, as a Python slice would print it.
  std::string s = "[";
  for (size_t i = 0; i < rank(); ++i) {
    if (i) s += ", ";
    s += std::to_string(offsets[i]) + ":" + std::to_string(offsets[i] + sizes[i]);
  }
  return s + "]";
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

void for_each_run(const Box& region, const Box& src, const Box& dst,
                  const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  const size_t r = region.rank();
  if (region.empty()) return;

  // Dims [inner, r) form one run: every dim after `inner` spans the full extent
  // of both src and dst, so stepping through it never leaves either's
  // contiguous range. Dim `inner` itself may be partial.
  size_t inner = r == 0 ? 0 : r - 1;
  while (inner > 0 && region.sizes[inner] == src.sizes[inner] &&
         region.sizes[inner] == dst.sizes[inner])
    --inner;
  int64_t run = 1;
  for (size_t k = inner; k < r; ++k) run *= region.sizes[k];

  std::vector<int64_t> src_stride(r), dst_stride(r);
  int64_t s_acc = 1, d_acc = 1;
  for (size_t k = r; k-- > 0;) {
    src_stride[k] = s_acc;
    dst_stride[k] = d_acc;
    s_acc *= src.sizes[k];
    d_acc *= dst.sizes[k];
  }
  int64_t s_off = 0, d_off = 0;
  for (size_t k = 0; k < r; ++k) {
    s_off += (region.offsets[k] - src.offsets[k]) * src_stride[k];
    d_off += (region.offsets[k] - dst.offsets[k]) * dst_stride[k];
  }

  // Odometer over the outer dims [0, inner), updating offsets incrementally so
  // each run costs O(1) amortized.
  std::vector<int64_t> idx(inner, 0);
  while (true) {
    fn(s_off, d_off, run);
    size_t k = inner;
    while (k > 0) {
      --k;
      if (++idx[k] < region.sizes[k]) {
        s_off += src_stride[k];
        d_off += dst_stride[k];
        break;
      }
      s_off -= (region.sizes[k] - 1) * src_stride[k];
      d_off -= (region.sizes[k] - 1) * dst_stride[k];
      idx[k] = 0;
      if (k == 0) return;
    }
    if (inner == 0) return;
  }
}

}  // namespace ferry
