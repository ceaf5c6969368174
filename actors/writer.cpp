// Writer: blocking file I/O on its own thread (a detached actor), so the
// scheduler's threads never wait on the disk. It returns each block's lease
// as soon as its pwrite is done (an object store's part: once stored, several
// parts in flight) and fsyncs once per file, at the end. The
// I/O itself is a StorageWriter's (src/storage_writer.hpp): Ferry's own
// files (PosixStorageWriter), or the caller's checkpoint_fn.
//
// The writers own the descriptors of a save: a file is opened, truncated,
// fsynced and closed here only. A file's blocks are spread over all writers,
// so after a failure the planner first has every writer drain its mailbox
// (`drain`), then has one of them close the files (`close`): no descriptor
// is closed while another writer may still be inside a call on it.
//
// A writer stuck in a call (a stalled disk, a checkpoint_fn that never
// returns) is retired by the planner at the failed save's drain deadline:
// a fresh writer takes its place, and this one, once its call returns,
// writes none of what was queued (returning the blocks), closes nothing
// itself (the files close as the last reference to them goes), and ends at
// `retire`. Its descriptors stay open, and so never reused, while it may
// still write through them.
//
// A save's compression runs here too (CPU work that must not hold a
// scheduler thread): a failed save's drain then queues behind it, and ends
// only once the caller's tensors are no longer read.
//
//   (stateless) write | open | seal | drain | close | custom | compress, one at a time
//               retire: the end (after a retirement)

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <future>
#include <thread>

#include "actors/messages.hpp"
#include "actors/writer_actor.hpp"
#include "codec.hpp"
#include "cpus.hpp"
#include "storage_writer.hpp"

namespace ferry {

namespace {

// Compresses every chunk, from the caller's tensors (untouched until the
// snapshot is done), the frames of all chunks spread over up to 8
// threads, and points each source at its stored bytes: the snapshot,
// checksums and writers then handle them like any chunk.
Status compress_chunks(const RankContext& ctx, int level, FileChunks& chunks) {
  auto& refs = chunks.refs;
  auto& srcs = chunks.srcs;
  std::vector<RawSpan> spans;
  std::deque<std::vector<uint8_t>> staged;  // device or strided tensors, gathered first
  for (size_t f = 0; f < refs.size(); ++f)
    for (size_t c = 0; c < refs[f].size(); ++c) {
      const ChunkSource& src = srcs[f][c];
      const uint64_t n = refs[f][c].nbytes();
      const uint8_t* bytes = static_cast<const uint8_t*>(src.view.data) + src.offset;
      if (!src.view.device.is_host() || !src.view.is_contiguous()) {
        staged.emplace_back(n);
        std::promise<Status> copied;
        ctx.device->copy_out(src.view, src.offset, n, staged.back().data(),
                             [&copied](Status s) { copied.set_value(std::move(s)); });
        FERRY_RETURN_IF_ERROR(copied.get_future().get());
        bytes = staged.back().data();
      }
      spans.push_back({bytes, n, "compressing tensor '" + refs[f][c].key + "'"});
    }
  const uint32_t threads = std::max(2u, std::min(8u, usable_cpus()));
  FERRY_ASSIGN_OR_RETURN(std::vector<Compressed> z, compress_spans(spans, level, threads));
  size_t k = 0;
  for (size_t f = 0; f < refs.size(); ++f)
    for (size_t c = 0; c < refs[f].size(); ++c) {
      auto stored = std::make_shared<const Compressed>(std::move(z[k++]));
      srcs[f][c].view = TensorView(const_cast<uint8_t*>(stored->data.data()), DType::u8,
                                   {static_cast<int64_t>(stored->data.size())});
      srcs[f][c].offset = 0;
      refs[f][c].compressed = std::move(stored);
    }
  return Status();
}

// The writes handed off by a writer and not yet stored.
class WritesInFlight {
 public:
  void add() {
    std::lock_guard<std::mutex> lock(mu_);
    ++n_;
  }
  void end() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--n_ == 0) none_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    none_.wait(lock, [&] { return n_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable none_;
  int n_ = 0;
};

struct writer_state {
  static inline const char* name = "ferry.writer";
  ContextPtr ctx;
  planner_actor planner;
  std::shared_ptr<WriterWatch> watch;
  std::unique_ptr<PosixStorageWriter> storage;
  std::shared_ptr<WritesInFlight> in_flight = std::make_shared<WritesInFlight>();
};

// Marks a blocking call for the planner's timeout messages while it runs.
class Doing {
 public:
  Doing(WriterWatch& w, std::string what, bool reads_caller = false) : w_(w) {
    w_.begin(std::move(what), reads_caller);
  }
  ~Doing() { w_.end(); }
  Doing(const Doing&) = delete;
  Doing& operator=(const Doing&) = delete;

 private:
  WriterWatch& w_;
};

Status retired_status() {
  return Status::aborted("the writer was abandoned after a stuck call");
}

writer_actor::behavior_type writer_fun(writer_actor::stateful_pointer<writer_state> self,
                                       ContextPtr ctx, planner_actor planner,
                                       std::shared_ptr<WriterWatch> watch) {
  self->state.storage =
      std::make_unique<PosixStorageWriter>(ctx->fs, ctx->opts.direct_io, ctx->opts.fsync);
  self->state.ctx = std::move(ctx);
  self->state.planner = std::move(planner);
  self->state.watch = std::move(watch);
  return {
      [self](atom::write, const WriteBlock& w) {
        auto& st = self->state;
        // The block goes back, and the planner hears of it, once its bytes
        // are stored: at once, or on a sender thread where the file keeps
        // parts in flight (an object store's). Returning the block first
        // lets the snapshot refill it while the planner handles the report
        // (or the serializer release it once hashed, when it deferred
        // hashing to keep the snapshot's core free).
        auto report = [pool = st.ctx->pool, planner = st.planner, block = w.block,
                       to = w.return_to](Status status) {
          if (to)
            caf::anon_send(to, atom::back_v, block);
          else
            (void)pool->release(block.lease);
          caf::anon_send(planner, atom::written_v, block.save, block.file, block.len, status);
        };
        auto data = st.ctx->pool->data(w.block.lease);
        if (!data.ok()) return report(data.status());
        if (st.watch->retired || w.block.save == st.watch->dropped_save->load()) {
          // A failed save's blocks queued here: its drain need not wait for them.
          return report(Status::aborted("not written: the save failed"));
        }
        Doing doing(*st.watch,
                    "pwrite of " + w.file->path() + " at byte " + std::to_string(w.block.offset));
        st.in_flight->add();
        st.storage->write_async(*w.file, *data, w.write_len, w.block.offset,
                                [report, in_flight = st.in_flight](Status status) {
                                  report(std::move(status));
                                  in_flight->end();
                                });
      },
      [self](atom::open, const OpenFiles& req) -> FileSet {
        FileSet out;
        if (self->state.watch->retired) {
          out.status = retired_status();
          return out;
        }
        Doing doing(
            *self->state.watch,
            "creating the data files " + (req.paths.empty() ? "" : req.paths[0]) +
                (req.paths.size() > 1 ? " and " + std::to_string(req.paths.size() - 1) + " more"
                                      : ""));
        auto files = self->state.storage->open_checkpoint(req.paths);
        if (!files.ok()) {
          out.status = files.status();
          return out;
        }
        // Allocated up front (to the O_DIRECT padding) so that the writers'
        // blocks of one file are written side by side, not one at a time,
        // and a disk too full for the save fails it before any write.
        for (size_t f = 0; f < files->size() && f < req.sizes.size(); ++f) {
          File& file = *(*files)[f];
          const uint64_t size = file.direct() ? direct_io_bytes(req.sizes[f]) : req.sizes[f];
          if (Status s = file.reserve(size); !s.ok()) {
            out.status = std::move(s);
            return out;  // the files close as they go out of scope
          }
        }
        out.files = std::move(files).value();
        return out;
      },
      [self](atom::seal, const std::shared_ptr<File>& f, uint64_t size) -> Status {
        if (self->state.watch->retired) return retired_status();
        Doing doing(*self->state.watch, "truncate, fsync and close of " + f->path());
        return self->state.storage->finish_file(0, f.get(), size);
      },
      // A barrier: answered after every block queued here before it is
      // stored (or failed), parts in flight included.
      [self](atom::drain) {
        Doing doing(*self->state.watch, "waiting for its object-store parts in flight");
        self->state.in_flight->wait();
        return true;
      },
      // The end of a failed save (after every writer drained): its errors
      // are moot, the save already has one.
      [self](atom::close, const std::vector<std::shared_ptr<File>>& files) {
        if (self->state.watch->retired) return true;
        Doing doing(*self->state.watch,
                    "closing the data files of a failed save" +
                        (files.empty() ? "" : " (" + files[0]->path() + "...)"));
        self->state.storage->abort(files);
        return true;
      },
      // Blocking like every other call here: the function writes the files.
      [self](atom::compress, CompressJob& job) -> CompressDone {
        CompressDone out;
        if (self->state.watch->retired) {
          out.status = retired_status();
          return out;
        }
        Doing doing(*self->state.watch, "compressing the save's tensors", true);
        out.status = compress_chunks(*self->state.ctx, job.level, job.chunks);
        out.chunks = std::move(job.chunks);
        return out;
      },
      [self](atom::custom, const CustomWrite& w) -> CustomWritten {
        CustomWritten out;
        if (self->state.watch->retired) {
          out.status = retired_status();
          return out;
        }
        Doing doing(
            *self->state.watch,
            "checkpoint_fn writing " + (w.paths.empty() ? "" : w.paths[0]) +
                (w.paths.size() > 1 ? " and " + std::to_string(w.paths.size() - 1) + " more files"
                                    : ""));
        auto& s = *w.storage;
        auto opened = s.open_checkpoint(w.paths);
        out.status = opened.status();
        for (size_t f = 0; out.status.ok() && f < w.paths.size(); ++f) {
          out.status = s.finish_file(f, nullptr, 0);
          if (out.status.ok()) {
            out.layouts.push_back(s.written_layout(f));
            out.sums.push_back(s.written_sums(f));
          }
        }
        if (!out.status.ok()) s.abort({});
        return out;
      },
      [self](atom::retire) {
        self->state.ctx->stragglers->done();
        self->quit();
      },
  };
}

}  // namespace

std::string WriterWatch::describe() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (doing_.empty()) return "";
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - since_).count();
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", s);
  return doing_ + " (for " + buf + ")";
}

writer_actor spawn_writer(caf::local_actor* parent, ContextPtr ctx, planner_actor planner,
                          std::shared_ptr<WriterWatch> watch) {
  return parent->spawn<caf::detached + caf::linked>(writer_fun, std::move(ctx), std::move(planner),
                                                    std::move(watch));
}

}  // namespace ferry
