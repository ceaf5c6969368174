#include "storage_writer.hpp"

#include "async_file.hpp"
#include "checkpoint_fn.hpp"

namespace ferry {

Result<std::vector<std::shared_ptr<File>>> PosixStorageWriter::open_checkpoint(
    const std::vector<std::string>& paths) {
  OpenOptions o;
  o.write = o.create = o.exclusive = true;
  o.direct = direct_;
  std::vector<std::shared_ptr<File>> files;
  for (const auto& p : paths) {
    FERRY_ASSIGN_OR_RETURN(auto f, fs_->open(p, o));
    files.emplace_back(std::move(f));
    fs_->crash_point("writer.open");
  }
  return files;
}

Status PosixStorageWriter::write(File& f, const void* data, uint64_t len, uint64_t offset) {
  FERRY_RETURN_IF_ERROR(f.pwrite(data, len, offset));
  fs_->crash_point("writer.write");
  return Status();
}

void PosixStorageWriter::write_async(File& f, const void* data, uint64_t len, uint64_t offset,
                                     std::function<void(Status)> done) {
  auto* async = dynamic_cast<AsyncWriteFile*>(&f);
  if (!async) return done(write(f, data, len, offset));
  async->pwrite_async(data, len, offset, [fs = fs_, done = std::move(done)](Status s) {
    if (s.ok()) fs->crash_point("writer.write");
    done(std::move(s));
  });
}

// Cuts the O_DIRECT padding, makes the file durable and closes it.
Status PosixStorageWriter::finish_file(size_t, File* f, uint64_t size) {
  FERRY_RETURN_IF_ERROR(f->truncate(size));
  if (fsync_) {
    FERRY_RETURN_IF_ERROR(f->sync());
    fs_->crash_point("writer.fsync");
  }
  FERRY_RETURN_IF_ERROR(f->close());
  fs_->crash_point("writer.close");
  return Status();
}

void PosixStorageWriter::abort(const std::vector<std::shared_ptr<File>>& files) {
  for (const auto& f : files) (void)f->close();
}

Result<std::vector<std::shared_ptr<File>>> CheckpointFnWriter::open_checkpoint(
    const std::vector<std::string>& paths) {
  if (paths.size() != files_.size())
    return Status::internal("checkpoint_fn: " + std::to_string(paths.size()) + " files to open, " +
                            std::to_string(files_.size()) + " planned");
  paths_ = paths;
  written_.assign(paths.size(), FileLayout{});
  sums_.assign(paths.size(), {});
  return std::vector<std::shared_ptr<File>>{};
}

Status CheckpointFnWriter::write(File& f, const void*, uint64_t, uint64_t) {
  return Status::internal("checkpoint_fn writes " + f.path() + " whole, not in blocks");
}

Status CheckpointFnWriter::finish_file(size_t index, File*, uint64_t) {
  if (index >= paths_.size())
    return Status::internal("checkpoint_fn: file " + std::to_string(index) + " was not opened");
  std::deque<std::vector<uint8_t>> staged;  // this file's copies, freed once it is written
  FERRY_ASSIGN_OR_RETURN(
      StateDict planned,
      planned_state_dict(files_[index].layout, files_[index].sources, device_.get(), &staged));
  FERRY_RETURN_IF_ERROR(run_checkpoint_fn(fn_, planned, paths_[index]));
  FERRY_ASSIGN_OR_RETURN(written_[index],
                         adopt_written_file(*fs_, paths_[index], files_[index].layout,
                                            checksum_block_bytes_, &sums_[index], fsync_));
  return Status();
}

// What the function left behind stays in the pending directory, which the
// coordinator removes with the failed checkpoint.
void CheckpointFnWriter::abort(const std::vector<std::shared_ptr<File>>&) {}

}  // namespace ferry
