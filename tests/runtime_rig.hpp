// The runtime the actor tests start: small pool and chunks so that even a
// few MiB of state streams through it, real actors, real files.
#pragma once

#include <catch2/catch.hpp>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ferry/runtime.hpp"

namespace ferry::testing {

// A constructor rather than an aggregate: callers name the first fields only.
struct RigArgs {
  RigArgs(std::vector<std::pair<std::string, std::string>> settings_ = {},
          std::shared_ptr<Filesystem> fs_ = nullptr,
          std::shared_ptr<DeviceBackend> device_ = nullptr)
      : settings(std::move(settings_)), fs(std::move(fs_)), device(std::move(device_)) {}
  std::vector<std::pair<std::string, std::string>> settings;  // override the defaults below
  std::shared_ptr<Filesystem> fs;                             // default: POSIX
  std::shared_ptr<DeviceBackend> device;                      // default: host (+ CUDA)
};

// 4 MiB pool, 256 KiB chunks, 64 KiB checksum blocks under `root`.
inline std::unique_ptr<Runtime> make_test_runtime(const std::string& root, RigArgs a = {}) {
  RuntimeArgs args;
  args.set("root", root).set("pool-bytes", "4MiB").set("chunk-bytes", "256KiB");
  args.set("checksum-block-bytes", "64KiB");
  for (auto& [k, v] : a.settings) args.set(k, v);
  args.fs = std::move(a.fs);
  args.device = std::move(a.device);
  auto rt = Runtime::create(args);
  REQUIRE(rt.ok());
  return std::move(rt).value();
}

}  // namespace ferry::testing
