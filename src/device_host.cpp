#include "ferry/device.hpp"

#include "checksum.hpp"
#include "copy_bytes.hpp"
#include "populate.hpp"

#include <sys/mman.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ferry {

namespace {

struct Dim {
  int64_t size;
  int64_t stride;  // elements
};

// Drops size-1 dims and merges neighbours that are contiguous with each other,
// so a view that is strided only in its outer dims copies whole long rows.
std::vector<Dim> collapse_dims(const TensorView& v) {
  const auto strides = v.effective_strides();
  std::vector<Dim> dims;
  for (size_t k = 0; k < v.shape.size(); ++k) {
    if (v.shape[k] == 1) continue;
    dims.push_back({v.shape[k], strides[k]});
  }
  std::vector<Dim> out;
  for (const auto& d : dims) {
    if (!out.empty() && out.back().stride == d.stride * d.size) {
      out.back().size *= d.size;
      out.back().stride = d.stride;
    } else {
      out.push_back(d);
    }
  }
  return out;
}

// Copies of a megabyte or more use non-temporal stores. Out of a tensor
// (into the snapshot's pool blocks): the disk's DMA reads those bytes next,
// not this core; cached stores first read every destination line, then fill
// the cache with lines nobody reads, and on a VM whose disk writes run at
// memory speed that traffic slows the writes beside the snapshot (the save
// bench shows it in snapshot time and persist / raw). Into a tensor (a
// load's checked blocks): a load larger than the cache leaves nothing useful
// there, and skipping the reads of the destination saves the load CPU.
constexpr size_t kStreamMinBytes = 1 << 20;

#if defined(__x86_64__)
// 128 bytes a step, an aligned destination. kStream: non-temporal stores
// (copy_tensor_bytes, from a megabyte on); else plain ones (see
// copy_bytes.hpp).
template <bool kStream>
__attribute__((target("avx2"))) void avx2_copy(uint8_t* dst, const uint8_t* src, size_t n) {
  const size_t head = std::min<size_t>(n, (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
#pragma GCC unroll 4
    for (size_t k = 0; k < 128; k += 32) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i_u*>(src + i + k));
      if (kStream)
        _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + k), v);
      else
        _mm256_store_si256(reinterpret_cast<__m256i*>(dst + i + k), v);
    }
  }
  // Streaming stores are weakly ordered: fenced before the copy is reported
  // done and another thread hands the block to the disk.
  if (kStream) _mm_sfence();
  std::memcpy(dst + i, src + i, n - i);
}
#endif

// A copy between a tensor and a host buffer, either way: streaming from
// kStreamMinBytes on (see there), else copy_bytes.
void copy_tensor_bytes(uint8_t* dst, const uint8_t* src, size_t n) {
#if defined(__x86_64__)
  if (n >= kStreamMinBytes && has_avx2()) return avx2_copy<true>(dst, src, n);
#endif
  copy_bytes(dst, src, n);
}

template <bool kOut>
inline void move_bytes(uint8_t* tensor, uint8_t* host, size_t n) {
  if (kOut) {
    copy_tensor_bytes(host, tensor, n);
  } else {
    copy_tensor_bytes(tensor, host, n);
  }
}

// Whole elements of one strided row. The element size is a template argument
// so each memcpy compiles to a single load/store.
template <bool kOut, size_t N>
void move_elems(uint8_t* tensor, uint8_t* host, int64_t count, int64_t step) {
  for (int64_t i = 0; i < count; ++i, tensor += step, host += N) move_bytes<kOut>(tensor, host, N);
}

template <bool kOut>
void move_elems_any(uint8_t* tensor, uint8_t* host, int64_t count, int64_t step, size_t es) {
  switch (es) {
    case 1:
      return move_elems<kOut, 1>(tensor, host, count, step);
    case 2:
      return move_elems<kOut, 2>(tensor, host, count, step);
    case 4:
      return move_elems<kOut, 4>(tensor, host, count, step);
    case 8:
      return move_elems<kOut, 8>(tensor, host, count, step);
    default:
      for (int64_t i = 0; i < count; ++i, tensor += step, host += es)
        move_bytes<kOut>(tensor, host, es);
  }
}

// Moves bytes [offset, offset + len) of the view's row-major byte stream to
// or from `host`. The range may start and end inside an element.
template <bool kOut>
void strided_copy(const TensorView& v, uint64_t offset, uint64_t len, uint8_t* host) {
  if (len == 0) return;
  assert(offset + len <= v.nbytes());
  auto* base = static_cast<uint8_t*>(v.data);
  const uint64_t es = dtype_size(v.dtype);

  if (v.is_contiguous()) {
    move_bytes<kOut>(base + offset, host, len);
    return;
  }
  const auto dims = collapse_dims(v);
  if (dims.empty() || (dims.size() == 1 && dims[0].stride == 1)) {
    move_bytes<kOut>(base + offset, host, len);
    return;
  }

  const size_t r = dims.size();
  const int64_t row_elems = dims[r - 1].size;
  const int64_t step = dims[r - 1].stride * static_cast<int64_t>(es);
  const bool dense_rows = dims[r - 1].stride == 1;

  // Position of the first byte: row, column inside the row, byte inside the
  // element; then the row's address from its outer index.
  const auto first_elem = static_cast<int64_t>(offset / es);
  uint64_t within = offset % es;
  int64_t col = first_elem % row_elems;
  int64_t row = first_elem / row_elems;
  std::vector<int64_t> idx(r - 1, 0);
  int64_t row_off = 0;  // bytes
  for (size_t k = r - 1; k-- > 0;) {
    idx[k] = row % dims[k].size;
    row /= dims[k].size;
    row_off += idx[k] * dims[k].stride * static_cast<int64_t>(es);
  }

  uint64_t left = len;
  while (left > 0) {
    uint8_t* p = base + row_off;
    if (dense_rows) {
      const uint64_t start = static_cast<uint64_t>(col) * es + within;
      const uint64_t n = std::min<uint64_t>(left, static_cast<uint64_t>(row_elems) * es - start);
      move_bytes<kOut>(p + start, host, n);
      host += n;
      left -= n;
    } else {
      p += col * step;
      if (within) {
        const uint64_t n = std::min<uint64_t>(es - within, left);
        move_bytes<kOut>(p + within, host, n);
        host += n;
        left -= n;
        p += step;
        ++col;
      }
      const int64_t full = std::min<int64_t>(row_elems - col, static_cast<int64_t>(left / es));
      move_elems_any<kOut>(p, host, full, step, es);
      host += full * es;
      left -= full * es;
      col += full;
      p += full * step;
      if (left > 0 && col < row_elems) {
        // The range ends inside this element.
        move_bytes<kOut>(p, host, left);
        left = 0;
      }
    }
    within = 0;
    col = 0;
    for (size_t k = r - 1; k-- > 0;) {
      const int64_t bstride = dims[k].stride * static_cast<int64_t>(es);
      if (++idx[k] < dims[k].size) {
        row_off += bstride;
        break;
      }
      row_off -= (dims[k].size - 1) * bstride;
      idx[k] = 0;
    }
  }
}

// A load often fills tensors the caller just allocated, whose pages are not
// there yet: a memcpy then takes one page fault per 4 KiB, which costs more
// than the copy on a VM. One madvise faults the whole range in from the
// kernel instead (about a quarter less time measured here). It changes no
// byte (missing anonymous pages read as zero either way, and the copy
// overwrites them), and any error (an old kernel, a mapping that refuses it)
// only means the copy faults the pages in itself.
//
// Most loads fill parameters a model already initialised, though, whose
// pages are all there: the madvise would then only walk them again (about
// as much kernel time as the disk read itself). The range's last page tells
// the two apart: memory just allocated has none of its pages but the first,
// and a load copies in order, so a range partly there has its start. Once a
// tensor passed, its later ranges are not asked about: the loader copies a
// checksum block (1 MiB) at a time, and a mincore per block costs a
// noticeable part of a load's kernel time in system calls alone. A range
// that passes with pages missing takes their faults in the copy, as without
// any of this. t_populated: the tensor that passed last on this thread,
// valid while the generation (which each load moves on) is the same.
std::atomic<uint64_t> g_populated_generation{1};
thread_local std::pair<const void*, uint64_t> t_populated{nullptr, 0};

void populate_for_write(const void* tensor, uint8_t* p, uint64_t len) {
  constexpr uint64_t kWorthIt = 1 << 20;
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t generation = g_populated_generation.load(std::memory_order_relaxed);
  if (len < kWorthIt || t_populated == std::make_pair(tensor, generation)) return;
  const uint64_t begin = (reinterpret_cast<uint64_t>(p) + page - 1) / page * page;
  const uint64_t end = (reinterpret_cast<uint64_t>(p) + len) / page * page;
  if (end <= begin) return;
  unsigned char in = 0;
  if (::mincore(reinterpret_cast<void*>(end - page), page, &in) == 0 && (in & 1) != 0) {
    t_populated = {tensor, generation};
    return;
  }
  (void)populate_pages(reinterpret_cast<void*>(begin), end - begin);
}

}  // namespace

void forget_populated() {
  g_populated_generation.fetch_add(1, std::memory_order_relaxed);
}

namespace {

// Whether the kernel gives anonymous memory huge pages only where asked
// (transparent_hugepage/enabled = madvise): with `always` it does so
// already, with `never` or no such file not at all.
bool huge_pages_on_request() {
  static const bool yes = [] {
    char buf[128] = {};
    FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (!f) return false;
    const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
    std::fclose(f);
    return std::strstr(std::string(buf, n).c_str(), "[madvise]") != nullptr;
  }();
  return yes;
}

}  // namespace

bool advise_huge_pages(void* p, uint64_t n) {
  constexpr uint64_t kHuge = 2 << 20;
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const auto at = reinterpret_cast<uint64_t>(p);
  // Without one whole huge page inside the range, none of it could get one.
  if (n < kHuge || (at + kHuge - 1) / kHuge * kHuge + kHuge > at + n || !huge_pages_on_request())
    return false;
  // The range's last whole page tells fresh memory from memory in use, as
  // for populate_for_write (a partial one may hold the heap's header of the
  // next allocation); a model's initialised parameters keep their pages.
  unsigned char in = 0;
  const uint64_t last = (at + n) / page * page - page;
  if (::mincore(reinterpret_cast<void*>(last), page, &in) != 0 || (in & 1) != 0) return false;
  // Rounded out to whole pages, not in to huge ones: a tensor that has a
  // mapping of its own (a large malloc) then flags the mapping whole, and
  // neighbours in one heap flag adjacent ranges that merge, so no mapping
  // splits in two or three (the process's mapping count is bounded).
  const uint64_t begin = at / page * page;
  const uint64_t end = (at + n + page - 1) / page * page;
  return ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE) == 0;
}

namespace {

class HostDevice final : public DeviceBackend {
 public:
  bool handles(const Device& d) const override { return d.is_host(); }

  void copy_out(const TensorView& src, uint64_t offset, uint64_t len, void* dst,
                Done done) override {
    Status st = check(src, offset, len);
    if (st.ok()) strided_copy_out(src, offset, len, dst);
    done(std::move(st));
  }

  void copy_in(const void* src, const TensorView& dst, uint64_t offset, uint64_t len,
               Done done) override {
    if (!dst.device.is_host()) return done(check(dst, 0, 0));
    done(Target(dst).copy_in(src, offset, len));
  }

  void copy_in_runs(const uint8_t* src, const TensorView& dst, const std::vector<Run>& runs,
                    Done done) override {
    if (!dst.device.is_host()) return done(check(dst, 0, 0));
    // A column split brings thousands of 1-2 KiB runs per batch: the
    // tensor's size and layout are worked out once for all of them.
    const Target t(dst);
    for (const Run& r : runs) {
      Status st = t.copy_in(src + r.src, r.dst, r.len);
      if (!st.ok()) return done(std::move(st));
    }
    done(Status());
  }

  std::optional<uint64_t> copy_in_summed(const uint8_t* src, const TensorView& dst, uint64_t offset,
                                         uint64_t len) override {
    const Target t(dst);
    if (!dst.device.is_host() || !t.contiguous || offset > t.nbytes || len > t.nbytes - offset)
      return std::nullopt;
    uint8_t* at = static_cast<uint8_t*>(dst.data) + offset;
    populate_for_write(dst.data, at, len);
    return xxh3_64_copy(at, src, len);
  }

 private:
  // A host tensor being copied into, at once (this device is synchronous).
  struct Target {
    explicit Target(const TensorView& v)
        : view(v), nbytes(v.nbytes()), contiguous(v.is_contiguous()) {}
    Status copy_in(const void* src, uint64_t offset, uint64_t len) const {
      if (offset > nbytes || len > nbytes - offset) return range_error(offset, len, nbytes);
      if (!contiguous) {
        strided_copy_in(src, view, offset, len);
        return Status();
      }
      uint8_t* at = static_cast<uint8_t*>(view.data) + offset;
      populate_for_write(view.data, at, len);
      copy_tensor_bytes(at, static_cast<const uint8_t*>(src), len);
      return Status();
    }
    const TensorView& view;
    const uint64_t nbytes;
    const bool contiguous;
  };

  static Status range_error(uint64_t offset, uint64_t len, uint64_t nbytes) {
    return Status::invalid_argument("byte range [" + std::to_string(offset) + ", " +
                                    std::to_string(offset + len) + ") exceeds the tensor's " +
                                    std::to_string(nbytes) + " bytes");
  }

  static Status check(const TensorView& v, uint64_t offset, uint64_t len) {
    if (!v.device.is_host())
      return Status::invalid_argument("host device asked to copy a tensor on " +
                                      v.device.to_string());
    if (offset > v.nbytes() || len > v.nbytes() - offset)
      return range_error(offset, len, v.nbytes());
    return Status();
  }
};

}  // namespace

#if defined(__x86_64__)
bool has_avx2() {
  static const bool yes = (__builtin_cpu_init(), __builtin_cpu_supports("avx2"));
  return yes;
}
#endif

void copy_bytes(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  // Below 2 KiB glibc copies with vector moves, whatever the distance.
  constexpr size_t kRepMovsbBytes = 2048;
  const uintptr_t ahead =
      (reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(src)) & 4095;
  if (n >= kRepMovsbBytes && ahead < 64 && has_avx2())
    return avx2_copy<false>(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n);
#endif
  std::memcpy(dst, src, n);
}

std::optional<uint64_t> DeviceBackend::copy_in_summed(const uint8_t*, const TensorView&, uint64_t,
                                                      uint64_t) {
  return std::nullopt;
}

void DeviceBackend::copy_in_runs(const uint8_t* src, const TensorView& dst,
                                 const std::vector<Run>& runs, Done done) {
  // Copies may report on other threads, in any order, before copy_in
  // returns: the count holds one extra until every copy is issued.
  struct Join {
    std::mutex mu;
    size_t left;
    Status first;
    Done done;
  };
  auto join = std::make_shared<Join>();
  join->left = runs.size() + 1;
  join->done = std::move(done);
  auto arrive = [join](Status st) {
    std::unique_lock<std::mutex> l(join->mu);
    if (!st.ok() && join->first.ok()) join->first = std::move(st);
    if (--join->left > 0) return;
    Status first = std::move(join->first);
    l.unlock();
    join->done(std::move(first));
  };
  for (const Run& r : runs) copy_in(src + r.src, dst, r.dst, r.len, arrive);
  arrive(Status());
}

void strided_copy_out(const TensorView& src, uint64_t offset, uint64_t len, void* dst) {
  strided_copy<true>(src, offset, len, static_cast<uint8_t*>(dst));
}

void strided_copy_in(const void* src, const TensorView& dst, uint64_t offset, uint64_t len) {
  // The host buffer is only read on this path; the shared walker takes a
  // mutable pointer for both directions.
  strided_copy<false>(dst, offset, len, static_cast<uint8_t*>(const_cast<void*>(src)));
}

std::shared_ptr<DeviceBackend> host_device() {
  return std::make_shared<HostDevice>();
}

}  // namespace ferry
