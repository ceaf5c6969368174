// The writer's interface: blocking file I/O of a save, on its own thread.
#pragma once

#include <caf/all.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "actors/context.hpp"
#include "actors/messages.hpp"
#include "actors/planner_actor.hpp"

namespace ferry {

// What the planner sees of one writer from outside its thread (shared with
// it): the blocking call it is in, for a timeout's message, and whether the
// planner abandoned it. A writer stuck in a call cannot be stopped; the
// planner retires it (a fresh writer takes its place) and it ends once the
// call returns, writing nothing more.
struct WriterWatch {
  // The planner's: blocks of this save (a failed one) go back unwritten.
  std::shared_ptr<std::atomic<uint64_t>> dropped_save;
  std::atomic<bool> retired{false};

  // A blocking call starts; `reads_caller`: it reads the caller's tensors
  // (compression), so the writer must not be abandoned in it.
  void begin(std::string what, bool reads_caller = false) {
    std::lock_guard<std::mutex> lock(mu_);
    doing_ = std::move(what);
    reads_caller_ = reads_caller;
    since_ = std::chrono::steady_clock::now();
  }
  void end() {
    std::lock_guard<std::mutex> lock(mu_);
    doing_.clear();
    reads_caller_ = false;
  }
  // "" when idle, else e.g. "pwrite of /r/.pending-.../rank-00000-0000.safetensors
  // at byte 0 (for 5.1 s)".
  std::string describe() const;
  bool reads_caller() const {
    std::lock_guard<std::mutex> lock(mu_);
    return reads_caller_;
  }

 private:
  mutable std::mutex mu_;
  std::string doing_;
  bool reads_caller_ = false;
  std::chrono::steady_clock::time_point since_;
};

using writer_actor = caf::typed_actor<
    // serializer -> writer: pwrite one block; the planner hears `written`.
    caf::reacts_to<atom::write, WriteBlock>,
    // planner -> writer: create the data files of a save, each allocated
    // to its size.
    caf::replies_to<atom::open, OpenFiles>::with<FileSet>,
    // planner -> writer: truncate to the size, fsync and close one file.
    caf::replies_to<atom::seal, std::shared_ptr<File>, uint64_t>::with<Status>,
    // planner -> writer after a failure: a barrier behind every queued block,
    caf::replies_to<atom::drain>::with<bool>,
    // then the close of the failed save's files.
    caf::replies_to<atom::close, std::vector<std::shared_ptr<File>>>::with<bool>,
    // planner -> writer: the caller's checkpoint_fn writes the rank's files,
    // made durable.
    caf::replies_to<atom::custom, CustomWrite>::with<CustomWritten>,
    // planner -> writer: compress a save's chunks from the caller's tensors.
    caf::replies_to<atom::compress, CompressJob>::with<CompressDone>,
    // planner -> a retired writer, after everything queued there: end.
    caf::reacts_to<atom::retire>>;

// Detached and linked to `parent` (the planner); `watch` is shared with it.
writer_actor spawn_writer(caf::local_actor* parent, ContextPtr ctx, planner_actor planner,
                          std::shared_ptr<WriterWatch> watch);

}  // namespace ferry
