// Where tensor bytes live. Copies between a tensor and host memory are
// asynchronous: completion arrives through the callback, possibly on another
// thread, possibly before copy_* returns (the host device copies at once).
// The CUDA implementation orders its copies after the caller's stream.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "ferry/status.hpp"
#include "ferry/tensor.hpp"

namespace ferry {

class DeviceBackend {
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
};

// Plain memcpy for host tensors; strided views are gathered/scattered.
std::shared_ptr<DeviceBackend> host_device();

// Synchronous strided helpers the host device is made of.
void strided_copy_out(const TensorView& src, uint64_t offset, uint64_t len, void* dst);
void strided_copy_in(const void* src, const TensorView& dst, uint64_t offset, uint64_t len);

}  // namespace ferry
