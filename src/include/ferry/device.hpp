// Where tensor bytes live. Copies between a tensor and host memory are
// asynchronous: completion arrives through the callback, possibly on another
// thread, possibly before copy_* returns (the host device copies at once).
// The CUDA implementation orders its copies after the caller's stream.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "ferry/export_macro.hpp"
#include "ferry/status.hpp"
#include "ferry/tensor.hpp"

namespace ferry {

class FERRY_EXPORT DeviceBackend {
 public:
  using Done = std::function<void(Status)>;
  virtual ~DeviceBackend() = default;
  virtual bool handles(const Device& d) const = 0;
  // Copies bytes [offset, offset + len) of `src`'s row-major byte stream
  // (strides honoured) into host memory `dst`.
  virtual void copy_out(const TensorView& src, uint64_t offset, uint64_t len, void* dst,
                        Done done) = 0;
  // Copies `len` host bytes into bytes [offset, offset + len) of `dst`'s
  // row-major byte stream.
  virtual void copy_in(const void* src, const TensorView& dst, uint64_t offset, uint64_t len,
                       Done done) = 0;

  // One piece of a batched copy: `len` bytes at `src` past the host base go
  // to bytes [dst, dst + len) of the tensor's row-major byte stream.
  struct Run {
    uint64_t src, dst, len;
  };
  // Copies many pieces of one host buffer into `dst` and reports once, after
  // the last. A load split by columns copies a few KiB per piece, and a
  // callback and a lock per piece cost as much as its bytes. `runs` is read
  // before this returns. The default calls copy_in for each run.
  virtual void copy_in_runs(const uint8_t* src, const TensorView& dst, const std::vector<Run>& runs,
                            Done done);

  // Copies like copy_in, before it returns, and sums the bytes with XXH3-64
  // (the checksum of the manifest) in the same pass: a load copies 1 MiB
  // blocks it must verify, and reading each once takes a fifth less CPU than
  // hashing and then copying it. nullopt where this backend cannot (the
  // default): `dst` is then untouched and the caller hashes and copies apart.
  virtual std::optional<uint64_t> copy_in_summed(const uint8_t* src, const TensorView& dst,
                                                 uint64_t offset, uint64_t len);
};

// Plain memcpy for host tensors; strided views are gathered/scattered.
FERRY_EXPORT std::shared_ptr<DeviceBackend> host_device();

// Synchronous strided helpers the host device is made of.
FERRY_EXPORT void strided_copy_out(const TensorView& src, uint64_t offset, uint64_t len, void* dst);
FERRY_EXPORT void strided_copy_in(const void* src, const TensorView& dst, uint64_t offset,
                                  uint64_t len);

}  // namespace ferry
