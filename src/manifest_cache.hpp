// What one owner (a Runtime) knows of the manifests it read: summaries by
// payload checksum (a manifest is never rewritten in place, so that names
// its content; one corrupted in place since keeps its old summary here, so a
// commit at most picks a larger number than needed), what retention and
// find_latest need of those that decoded whole, by file and payload
// checksum (a file rewritten has another inode or mtime and is decoded
// again), whole manifests for loads (see manifest()), and the manifests
// that failed, by path, size, inode and mtime, so that a bad one costs one
// read per owner rather than one per save or `ls`. Owned, never process-global: two runtimes in one
// process (other roots, other filesystems) never see each other's entries.
// Thread-safe.
#pragma once

#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

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

  // What retention and find_latest need of a manifest that decoded whole
  // (decode_manifest and its checks passed): its numbers and files. Keyed by the file as it
  // was (path, size, inode, mtime) and its payload checksum, so a manifest
  // rewritten or moved is decoded again.
  struct Decoded {
    uint64_t step = 0;
    uint64_t commit_seq = 0;
    uint64_t total_bytes = 0;
    uint64_t tensors = 0;
    std::vector<ManifestFile> files;
  };
  std::shared_ptr<const Decoded> decoded(const FailureKey& key, uint64_t payload_sum) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = decoded_.find(key);
    if (it == decoded_.end() || it->second.first != payload_sum) return nullptr;
    return it->second.second;
  }
  void remember_decoded(const FailureKey& key, uint64_t payload_sum,
                        std::shared_ptr<const Decoded> d) {
    std::lock_guard<std::mutex> lock(mu_);
    if (decoded_.size() >= kMaxRemembered) decoded_.clear();
    decoded_[key] = {payload_sum, std::move(d)};
  }

  // Whole manifests as decode_manifest gave them, for a load to plan
  // against what ferry_manifest_open on the same runtime (or its last load
  // of the checkpoint) already decoded: keyed by the checkpoint directory,
  // the file's length and its payload checksum, which the caller checked
  // against the bytes it read (summarize_manifest), so a manifest replaced or
  // changed on disk is decoded again. The last one remembered is kept; the
  // others only while someone holds them (a decoded manifest of 100,000
  // tensors is tens of MiB).
  std::shared_ptr<const Manifest> manifest(const std::string& dir, uint64_t file_bytes,
                                           uint64_t payload_sum) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = manifests_.find({dir, file_bytes, payload_sum});
    if (it == manifests_.end()) return nullptr;
    return it->second.lock();
  }
  void remember_manifest(const std::string& dir, uint64_t file_bytes, uint64_t payload_sum,
                         std::shared_ptr<const Manifest> m) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = manifests_.begin(); it != manifests_.end();)
      it = it->second.expired() ? manifests_.erase(it) : std::next(it);
    if (manifests_.size() >= kMaxRemembered) manifests_.clear();
    manifests_[{dir, file_bytes, payload_sum}] = m;
    last_manifest_ = std::move(m);
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
  std::map<FailureKey, std::pair<uint64_t, std::shared_ptr<const Decoded>>> decoded_;
  std::map<std::tuple<std::string, uint64_t, uint64_t>, std::weak_ptr<const Manifest>> manifests_;
  std::shared_ptr<const Manifest> last_manifest_;
};

}  // namespace ferry
