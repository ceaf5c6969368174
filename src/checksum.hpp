#pragma once

#include <cstddef>
#include <cstdint>

namespace ferry {

uint64_t xxh3_64(const void* data, size_t len);

// Copies `len` bytes from `src` to `dst` (which must not overlap) and
// returns xxh3_64(src, len), reading each byte once: the load's copy of a
// checked block into a tensor, which hashed and then copied the block
// from the cache in 0.145 s per 2 GiB and does both in one pass in 0.115 s
// here. Stores bypass the cache where the CPU has AVX2: nothing reads the
// destination soon.
uint64_t xxh3_64_copy(void* dst, const void* src, size_t len);

// Incremental xxh3-64 over a byte stream, equal to xxh3_64 of the whole.
class StreamingChecksum {
 public:
  StreamingChecksum();
  ~StreamingChecksum();
  StreamingChecksum(const StreamingChecksum&) = delete;
  StreamingChecksum& operator=(const StreamingChecksum&) = delete;
  void reset();
  void update(const void* data, size_t len);
  uint64_t digest() const;

 private:
  void* state_;
};

}  // namespace ferry
