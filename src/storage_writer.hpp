// Where one rank's data files of a checkpoint go, in the steps the planner
// drives: open the checkpoint's files, write items' bytes, finish each file
// (durable and closed), or abort. The files' directory entries are made
// durable once, by rank 0's fsync of the pending directory after it wrote
// MANIFEST there, before the commit rename (one fsync for every rank's files). Two kinds: Ferry's
// own files on a Filesystem (the writer actors run it, one call at a time per thread), and the
// caller's checkpoint_fn, which writes a rank's file by itself.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint_fn.hpp"
#include "ferry/device.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/save_plan.hpp"
#include "layout.hpp"

namespace ferry {

class StorageWriter {
 public:
  virtual ~StorageWriter() = default;
  // Creates the rank's files of a checkpoint (paths in its pending
  // directory). The handles may be empty where the writer keeps none.
  virtual Result<std::vector<std::shared_ptr<File>>> open_checkpoint(
      const std::vector<std::string>& paths) = 0;
  // Writes `len` bytes of items at `offset` of file `f`.
  virtual Status write(File& f, const void* data, uint64_t len, uint64_t offset) = 0;
  // File `index` of open_checkpoint is complete at `size` bytes: durable and closed.
  virtual Status finish_file(size_t index, File* f, uint64_t size) = 0;
  // The save failed: close what is open; errors are moot.
  virtual void abort(const std::vector<std::shared_ptr<File>>& files) = 0;
};

// Ferry's own files: O_DIRECT when asked, fsync when `fsync`.
class PosixStorageWriter : public StorageWriter {
 public:
  PosixStorageWriter(std::shared_ptr<Filesystem> fs, bool direct, bool fsync)
      : fs_(std::move(fs)), direct_(direct), fsync_(fsync) {}
  Result<std::vector<std::shared_ptr<File>>> open_checkpoint(
      const std::vector<std::string>& paths) override;
  Status write(File& f, const void* data, uint64_t len, uint64_t offset) override;
  // write(), handed off where the file takes it (an object store's data
  // file keeps several parts in flight): `done` runs once the bytes are
  // stored or failed, maybe on another thread, maybe before this returns;
  // `data` must stay valid until then.
  void write_async(File& f, const void* data, uint64_t len, uint64_t offset,
                   std::function<void(Status)> done);
  Status finish_file(size_t index, File* f, uint64_t size) override;
  void abort(const std::vector<std::shared_ptr<File>>& files) override;

 private:
  std::shared_ptr<Filesystem> fs_;
  bool direct_;
  bool fsync_;
};

// The caller's checkpoint_fn: it writes each file whole at finish_file, from
// the planned tensors; what it wrote is read back, checked against the
// planned layout and checksummed (written_layout / written_sums).
class CheckpointFnWriter : public StorageWriter {
 public:
  struct PlannedFile {
    FileLayout layout;                   // the chunks the file must hold
    std::vector<PlannedSource> sources;  // where each starts in the caller's memory
  };
  // `device` copies chunks the function cannot read in place (strided, or on
  // a device) into host memory, one file's worth at a time.
  CheckpointFnWriter(std::shared_ptr<Filesystem> fs, CheckpointFn fn,
                     std::vector<PlannedFile> files, std::shared_ptr<DeviceBackend> device,
                     uint64_t checksum_block_bytes, bool fsync)
      : fs_(std::move(fs)),
        fn_(std::move(fn)),
        files_(std::move(files)),
        device_(std::move(device)),
        checksum_block_bytes_(checksum_block_bytes),
        fsync_(fsync) {}
  Result<std::vector<std::shared_ptr<File>>> open_checkpoint(
      const std::vector<std::string>& paths) override;
  // Refused: the function writes whole files.
  Status write(File& f, const void* data, uint64_t len, uint64_t offset) override;
  Status finish_file(size_t index, File* f, uint64_t size) override;
  void abort(const std::vector<std::shared_ptr<File>>& files) override;

  const FileLayout& written_layout(size_t index) const { return written_[index]; }
  const std::vector<std::vector<uint64_t>>& written_sums(size_t index) const {
    return sums_[index];
  }

 private:
  std::shared_ptr<Filesystem> fs_;
  CheckpointFn fn_;
  std::vector<PlannedFile> files_;
  std::shared_ptr<DeviceBackend> device_;
  uint64_t checksum_block_bytes_;
  bool fsync_;
  std::vector<std::string> paths_;
  std::vector<FileLayout> written_;
  std::vector<std::vector<std::vector<uint64_t>>> sums_;
};

}  // namespace ferry
