#pragma once

#include <cstddef>
#include <cstdint>

namespace ferry {

uint64_t xxh3_64(const void* data, size_t len);

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
