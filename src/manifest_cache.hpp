// What one owner (a Runtime) knows of the manifests it read: summaries by
// payload checksum (a manifest is never rewritten in place, so that names
// its content; one corrupted in place since keeps its old summary here, so a
// commit at most picks a larger number than needed, and find_latest still
// decodes its choice whole), and the manifests that failed, by path, size,
// inode and mtime, so that a bad one costs one read per owner rather than
// one per save or `ls`. Owned, never process-global: two runtimes in one
// process (other roots, other filesystems) never see each other's entries.
// Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>

#include "ferry/status.hpp"
#include "manifest.hpp"

namespace ferry {

class ManifestCache {
 public:
  // A manifest file as it was when it failed: path, size, inode, mtime.
  using FailureKey = std::tuple<std::string, uint64_t, uint64_t, int64_t>;
  // The most entries of each kind kept; past it the kind starts again empty.
  static constexpr size_t kMaxRemembered = 1 << 16;

  std::optional<ManifestSummary> summary(uint64_t payload_sum) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_sum_.find(payload_sum);
    if (it == by_sum_.end()) return std::nullopt;
    return it->second;
  }
  void remember_summary(const ManifestSummary& s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (by_sum_.size() >= kMaxRemembered) by_sum_.clear();
    by_sum_.emplace(s.payload_sum, s);
  }

  // The failure remembered for the file at `key`; with `frame_only`, only a
  // failure of its frame (a manifest whose tensors failed still summarizes).
  std::optional<Status> failure(const FailureKey& key, bool frame_only) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = failed_.find(key);
    if (it == failed_.end() || (frame_only && !it->second.frame)) return std::nullopt;
    return it->second.status;
  }
  // `frame`: the frame or payload checksum failed (no summary either).
  void remember_failure(const FailureKey& key, const Status& st, bool frame) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.size() >= kMaxRemembered) failed_.clear();
    failed_[key] = {st, frame};
  }

  size_t summaries() {
    std::lock_guard<std::mutex> lock(mu_);
    return by_sum_.size();
  }

 private:
  struct Failure {
    Status status;
    bool frame = false;
  };
  std::mutex mu_;
  std::unordered_map<uint64_t, ManifestSummary> by_sum_;
  std::map<FailureKey, Failure> failed_;
};

}  // namespace ferry
