// What a checkpoint is made of, seen as objects: data files, MANIFEST,
// LATEST, lease records, each under a '/'-separated key relative to the
// store's root. A directory (through Filesystem, so injected faults apply)
// and an S3 bucket prefix are both stores; one conformance suite
// (tests/s3/store_test.cpp) holds every store to the same contract.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ferry/filesystem.hpp"
#include "ferry/status.hpp"

namespace ferry {

struct ObjectEntry {
  std::string key;
  uint64_t size = 0;
};

// An upload begun and neither finished nor aborted (S3's multipart uploads).
struct PendingUpload {
  std::string key;
  std::string id;
  int64_t started_unix_ms = 0;
};

// Writes one object from pieces, in any order and from several threads.
// Nothing is visible under the key before finish; abort leaves nothing.
class ObjectWriter {
 public:
  virtual ~ObjectWriter() = default;
  // Writes [offset, offset + len). `offset` is a multiple of the store's
  // part_bytes(), and so is `len` unless the piece ends the object.
  virtual Status write(uint64_t offset, const void* data, size_t len) = 0;
  // write() that may end after it returns: `done` runs once the bytes are
  // stored or failed (maybe on another thread, maybe before this returns),
  // and `data` must stay valid until then. finish() and abort() wait for
  // every write in flight.
  virtual void write_async(uint64_t offset, const void* data, size_t len,
                           std::function<void(Status)> done) {
    done(write(offset, data, len));
  }
  // Every byte of [0, size) was written: the object is durable and visible
  // when this returns.
  virtual Status finish(uint64_t size) = 0;
  // Drops what was written. Idempotent; an unfinished writer aborts when
  // it is destroyed.
  virtual Status abort() = 0;
};

class Store {
 public:
  virtual ~Store() = default;
  // Where the store is ("/data/run1", "s3://bucket/run1"), for messages.
  virtual const std::string& root() const = 0;
  // The unit of ObjectWriter pieces (1 where any piece size goes).
  virtual uint64_t part_bytes() const = 0;

  virtual Result<std::unique_ptr<ObjectWriter>> create(const std::string& key) = 0;
  // Up to `len` bytes at `offset`; fewer only at the object's end.
  virtual Result<size_t> read(const std::string& key, uint64_t offset, void* out, size_t len) = 0;
  // The whole object, refused naming its size above `max_bytes`.
  virtual Result<std::string> read_all(const std::string& key, uint64_t max_bytes) = 0;
  virtual Result<uint64_t> size(const std::string& key) = 0;  // not_found when absent
  // Every object whose key starts with `prefix`, sorted by key. Objects
  // being written (not yet finished) are not listed.
  virtual Result<std::vector<ObjectEntry>> list(const std::string& prefix) = 0;
  // The names one level below `prefix` (which ends in '/' or is empty):
  // objects and sub-prefixes alike, each once, sorted. What a directory
  // listing is; S3 answers it without listing everything below.
  virtual Result<std::vector<std::string>> children(const std::string& prefix) {
    Result<std::vector<ObjectEntry>> all = list(prefix);
    if (!all.ok()) return all.status();
    std::vector<std::string> names;
    for (const ObjectEntry& e : all.value()) {
      std::string name = e.key.substr(prefix.size());
      name = name.substr(0, name.find('/'));
      if (!name.empty() && (names.empty() || names.back() != name)) names.push_back(name);
    }
    return names;
  }
  // Replaces the object at once: a reader sees the old bytes or the new.
  virtual Status put(const std::string& key, const std::string& bytes) = 0;
  // Creates the object only if the key is free: already_exists otherwise,
  // also when another writer races this one (exactly one of them wins).
  virtual Status put_if_absent(const std::string& key, const std::string& bytes) = 0;
  // Deletes the objects; an absent key is not an error.
  virtual Status remove(const std::vector<std::string>& keys) = 0;
  // Uploads under `prefix` that a writer left unfinished (a crash), for gc:
  // they hold storage but are no object. None where writes leave nothing.
  virtual Result<std::vector<PendingUpload>> uploads(const std::string& prefix) {
    (void)prefix;
    return std::vector<PendingUpload>{};
  }
  virtual Status abort_upload(const PendingUpload& u) {
    return Status::unsupported(root() + ": no upload " + u.key);
  }
};

// A key is a relative path of non-empty components: no leading '/', no
// "." or "..", no control characters. The error names the key.
Status check_object_key(const std::string& key);

// The store of a directory: objects are files under `dir` (created if
// absent), written to a temporary name and renamed at finish.
Result<std::shared_ptr<Store>> directory_store(std::shared_ptr<Filesystem> fs,
                                               const std::string& dir);

}  // namespace ferry
