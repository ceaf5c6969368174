// What the C ABI's handles are, for tests that drive the C ABI over a
// runtime the C ABI cannot build (RuntimeArgs::device: the fake CUDA
// runtime). Not part of the public API.
#pragma once

#include <memory>

#include "ferry/ferry.h"
#include "ferry/runtime.hpp"

struct ferry_runtime {
  std::unique_ptr<ferry::Runtime> rt;
};

namespace ferry::detail {

// `rt` as a live C handle, released by ferry_runtime_destroy.
ferry_runtime* adopt_c_runtime(std::unique_ptr<Runtime> rt);

}  // namespace ferry::detail
