// Loader and readers. The loader splits a load plan over the readers and
// gathers their outcomes (a reader that dies fails its part, it never hangs
// the load). A reader packs its ops into aligned runs (make_read_runs), reads
// each run with one pread into a staging pool block (O_DIRECT where the
// filesystem takes it), keeps several reads in flight on helper threads
// while it verifies the checksum blocks of the run that landed and copies the
// requested bytes into the caller's tensors through the device. The pool is
// bounded: a load larger than it streams through the same few blocks.

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>

#include "actors/loader_actor.hpp"
#include "actors/messages.hpp"
#include "checksum.hpp"

namespace ferry {

namespace {

// O_DIRECT wants buffers, offsets and lengths aligned to the logical block
// size; 4096 covers every device we run on (the writer assumes the same).
constexpr uint64_t kAlign = 4096;
// Reads in flight per reader: enough to keep a virtual disk's queue busy
// while the reader verifies and copies the run that landed before.
constexpr size_t kReadsInFlight = 4;

struct reader_state {
  static inline const char* name = "ferry.reader";
  ContextPtr ctx;
};

// Verifies the checksum blocks of one read; the error names rank, tensor and file.
Status verify(const RankContext& ctx, const Manifest& m, const ReadOp& op, const std::string& path,
              const uint8_t* buf) {
  const ManifestChunk& c = m.tensors[op.tensor].chunks[op.chunk];
  if (c.checksums.empty()) return Status();
  const uint64_t cb = m.checksum_block_bytes;
  for (uint32_t i = 0; i < op.nblocks; ++i) {
    const uint64_t begin = static_cast<uint64_t>(i) * cb;
    const uint64_t n = std::min<uint64_t>(cb, op.length - begin);
    const uint32_t block = op.first_block + i;
    if (block >= c.checksums.size() || xxh3_64(buf + begin, n) != c.checksums[block])
      return Status::corruption("rank " + std::to_string(ctx.rank) +
                                ": checksum mismatch in tensor '" + m.tensors[op.tensor].key +
                                "' (chunk " + c.entry + ", block " + std::to_string(block) +
                                ") of file " + path);
  }
  return Status();
}

// Heap memory aligned for O_DIRECT, for what is not a pool block (the
// header, a checksum block larger than a pool block).
struct AlignedBuffer {
  explicit AlignedBuffer(uint64_t n)
      : p(static_cast<uint8_t*>(std::aligned_alloc(kAlign, std::max(kAlign, n)))) {}
  ~AlignedBuffer() { std::free(p); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  uint8_t* p;
};

// The header is not covered by the chunk checksums; its own checksum makes
// the data file as trustworthy as the chunks read from it.
Status verify_header(File& f, const ManifestFile& mf, const std::string& path) {
  if (mf.header_bytes == 0) return Status();
  const uint64_t len = (mf.header_bytes + kAlign - 1) / kAlign * kAlign;
  AlignedBuffer buf(len);
  if (!buf.p) return Status::internal("no memory for the header of file " + path);
  FERRY_ASSIGN_OR_RETURN(size_t got, f.pread(buf.p, len, 0));
  if (got < mf.header_bytes || xxh3_64(buf.p, mf.header_bytes) != mf.header_checksum)
    return Status::corruption("safetensors header of file " + path +
                              " does not match its checksum in the manifest");
  return Status();
}

// Waits for the copies of one run: the staging block is reused only after
// every copy out of it has landed (a device copies asynchronously).
class CopyLatch {
 public:
  void add() {
    std::lock_guard<std::mutex> l(mu_);
    ++issued_;
  }
  void arrive(Status s) {
    std::lock_guard<std::mutex> l(mu_);
    if (!s.ok() && first_.ok()) first_ = std::move(s);
    ++done_;
    cv_.notify_all();
  }
  Status wait() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [this] { return done_ == issued_; });
    return first_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t issued_ = 0, done_ = 0;
  Status first_;
};

// A data file as one reader uses it. `cache_fd` is a plain descriptor kept
// only to drop the pages a buffered read left in the page cache.
struct OpenFile {
  std::unique_ptr<File> file;
  std::string path;
  int cache_fd = -1;
  ~OpenFile() {
    if (cache_fd >= 0) ::close(cache_fd);
  }
};

// One pread in flight: the block it reads into and its outcome.
struct InFlight {
  const ReadRun* run = nullptr;
  OpenFile* file = nullptr;
  std::optional<Lease> lease;
  std::unique_ptr<AlignedBuffer> heap;  // only for a run larger than a pool block
  uint8_t* buf = nullptr;
  std::future<Result<size_t>> got;
};

class RunReader {
 public:
  RunReader(const RankContext& ctx, const ReadTask& task) : ctx_(ctx), task_(task) {}
  // Every read started is waited for and every block released, whatever failed.
  ~RunReader() {
    while (!inflight_.empty()) {
      if (inflight_.front().got.valid()) inflight_.front().got.wait();
      release(inflight_.front());
      inflight_.pop_front();
    }
  }

  Status run() {
    const uint64_t block = ctx_.pool->block_bytes();
    runs_ = make_read_runs(task_.ops, *task_.manifest, block, kAlign);
    size_t next = 0;
    while (next < runs_.size() || !inflight_.empty()) {
      while (next < runs_.size() && inflight_.size() < kReadsInFlight) {
        FERRY_ASSIGN_OR_RETURN(bool started, start(runs_[next], block));
        if (!started) break;
        ++next;
      }
      if (inflight_.empty()) {
        // The pool is empty (a save, or the other readers, hold every block)
        // and this reader holds none to wait on. The pool's one release hook
        // belongs to the save path, so poll: a block frees within a write,
        // and a save's writes end within write-timeout.
        const auto now = std::chrono::steady_clock::now();
        if (!waiting_since_) waiting_since_ = now;
        if (now - *waiting_since_ > std::chrono::duration<double>(ctx_.opts.write_timeout_s))
          return Status::timeout("rank " + std::to_string(ctx_.rank) +
                                 ": no staging pool block came free within write-timeout (" +
                                 std::to_string(ctx_.opts.write_timeout_s) + " s) for a load");
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        continue;
      }
      waiting_since_.reset();
      InFlight f = std::move(inflight_.front());
      inflight_.pop_front();
      Status s = finish(f);
      release(f);
      FERRY_RETURN_IF_ERROR(s);
    }
    // Readahead runs past the last run of this reader (into another reader's
    // stretch, which may have dropped it already): drop what is left.
    for (auto& [index, f] : files_)
      if (f->cache_fd >= 0) ::posix_fadvise(f->cache_fd, 0, 0, POSIX_FADV_DONTNEED);
    return Status();
  }

 private:
  Result<OpenFile*> open(uint32_t index) {
    auto& slot = files_[index];
    if (slot) return slot.get();
    auto f = std::make_unique<OpenFile>();
    f->path = join_path(task_.dir, task_.manifest->files[index].name);
    OpenOptions o;
    o.direct = ctx_.opts.direct_io;
    FERRY_ASSIGN_OR_RETURN(f->file, ctx_.fs->open(f->path, o));
    FERRY_RETURN_IF_ERROR(verify_header(*f->file, task_.manifest->files[index], f->path));
    if (!f->file->direct()) f->cache_fd = ::open(f->path.c_str(), O_RDONLY | O_CLOEXEC);
    slot = std::move(f);
    return slot.get();
  }

  // Starts the read of `run`; false when no staging block is free now.
  Result<bool> start(const ReadRun& run, uint64_t block) {
    InFlight f;
    f.run = &run;
    if (run.length <= block) {
      f.lease = ctx_.pool->try_acquire();
      if (!f.lease) return false;
      auto data = ctx_.pool->data(*f.lease);
      if (!data.ok()) {
        release(f);
        return data.status();
      }
      f.buf = data.value();
    } else {
      f.heap = std::make_unique<AlignedBuffer>(run.length);
      if (!f.heap->p)
        return Status::internal("no memory for a read of " + std::to_string(run.length) + " bytes");
      f.buf = f.heap->p;
    }
    auto file = open(run.file);
    if (!file.ok()) {
      release(f);
      return file.status();
    }
    f.file = file.value();
    File* fp = f.file->file.get();
    f.got = std::async(std::launch::async,
                       [fp, buf = f.buf, &run] { return fp->pread(buf, run.length, run.offset); });
    inflight_.push_back(std::move(f));
    return true;
  }

  Status finish(InFlight& f) {
    const ReadRun& run = *f.run;
    const Manifest& m = *task_.manifest;
    const std::string& path = f.file->path;
    Result<size_t> got = f.got.get();
    if (!got.ok()) return got.status();
    CopyLatch latch;
    Status s;
    for (const ReadOp& op : run.ops) {
      const uint64_t at = op.file_offset - run.offset;
      if (got.value() < at + op.length) {
        s = Status::corruption("rank " + std::to_string(ctx_.rank) + ": file " + path +
                               " is truncated: tensor '" + m.tensors[op.tensor].key +
                               "' needs bytes up to " + std::to_string(op.file_offset + op.length));
        break;
      }
      s = verify(ctx_, m, op, path, f.buf + at);
      if (!s.ok()) break;
      const TensorView& target = task_.targets[op.entry];
      const std::string& key = m.tensors[op.tensor].key;
      for_each_copy(op, dtype_size(target.dtype), [&](uint64_t src, uint64_t dst, uint64_t n) {
        latch.add();
        ctx_.device->copy_in(f.buf + at + src, target, dst, n, [&latch, key](Status st) {
          // The device names itself and the CUDA error; only we know the tensor.
          if (!st.ok()) st = st.with_context("tensor '" + key + "': ");
          latch.arrive(std::move(st));
        });
      });
    }
    // Copies already started read from the block and report to the latch:
    // wait for them even when a later op failed.
    Status copied = latch.wait();
    FERRY_RETURN_IF_ERROR(s);
    FERRY_RETURN_IF_ERROR(copied);
    // A buffered read leaves the checkpoint in the page cache, where it would
    // push out what the job needs: drop the pages of this run.
    if (f.file->cache_fd >= 0)
      ::posix_fadvise(f.file->cache_fd, static_cast<off_t>(run.offset),
                      static_cast<off_t>(run.length), POSIX_FADV_DONTNEED);
    return Status();
  }

  void release(InFlight& f) {
    if (f.lease) ctx_.pool->release(*f.lease);
    f.lease.reset();
  }

  const RankContext& ctx_;
  const ReadTask& task_;
  std::vector<ReadRun> runs_;
  std::map<uint32_t, std::unique_ptr<OpenFile>> files_;
  std::deque<InFlight> inflight_;
  std::optional<std::chrono::steady_clock::time_point> waiting_since_;
};

Status run_reads(reader_state& st, const ReadTask& task) {
  RunReader reader(*st.ctx, task);
  return reader.run();
}

reader_actor::behavior_type reader_fun(reader_actor::stateful_pointer<reader_state> self,
                                       ContextPtr ctx) {
  self->state.ctx = std::move(ctx);
  return {
      [self](atom::read, const ReadTask& task) -> Status { return run_reads(self->state, task); },
  };
}

// One load in flight: its promise and how many reader tasks are still out.
struct LoadInFlight {
  caf::response_promise rp;
  size_t left = 0;
  Status first_error;
};

// A read task handed to a reader and not yet answered.
struct ReaderTask {
  size_t reader = 0;
  std::shared_ptr<LoadInFlight> load;
};

using ReaderTasks = std::map<uint64_t, ReaderTask>;

// Every load is answered exactly once, whatever dies: a reader's reply, its
// death and the loader's own end each finish a task at most once.
//
//   idle --load--> reading --every task answered, or its reader died--> idle
struct loader_state {
  static inline const char* name = "ferry.loader";
  ContextPtr ctx;
  std::vector<reader_actor> readers;
  uint64_t next_task = 0;
  // Shared with the functor that answers what is left when the loader ends.
  std::shared_ptr<ReaderTasks> tasks = std::make_shared<ReaderTasks>();
};

using loader_ptr = loader_actor::stateful_pointer<loader_state>;

void finish_task(ReaderTasks& tasks, uint64_t id, Status s) {
  auto it = tasks.find(id);
  if (it == tasks.end()) return;
  auto load = std::move(it->second.load);
  tasks.erase(it);
  if (!s.ok() && load->first_error.ok()) load->first_error = std::move(s);
  if (--load->left == 0) load->rp.deliver(load->first_error);
}

reader_actor spawn_reader(loader_ptr self) {
  // Linked: readers end with the loader. Detached: preads block.
  return self->spawn<caf::detached + caf::linked>(reader_fun, self->state.ctx);
}

// A reader that died (an exception in a copy, say) no longer touches the
// caller's tensors: its tasks fail, and a new reader takes its place.
bool on_reader_exit(loader_ptr self, const caf::exit_msg& msg) {
  auto& st = self->state;
  for (size_t i = 0; i < st.readers.size(); ++i) {
    if (st.readers[i].address() != msg.source) continue;
    const Status why = Status::internal("reader " + std::to_string(i) +
                                        " died: " + self->system().render(msg.reason));
    std::vector<uint64_t> lost;
    for (const auto& [id, t] : *st.tasks)
      if (t.reader == i) lost.push_back(id);
    for (uint64_t id : lost) finish_task(*st.tasks, id, why);
    st.readers[i] = spawn_reader(self);
    return true;
  }
  return false;
}

loader_actor::behavior_type loader_fun(loader_ptr self, ContextPtr ctx) {
  self->state.ctx = ctx;
  for (uint32_t i = 0; i < ctx->opts.readers; ++i)
    self->state.readers.push_back(spawn_reader(self));
  self->set_exit_handler([self](caf::exit_msg& msg) {
    if (!on_reader_exit(self, msg)) self->quit(msg.reason);  // the runtime shuts down
  });
  self->attach_functor([tasks = self->state.tasks](const caf::error& reason) {
    const Status why = Status::internal("the loader stopped (" + caf::to_string(reason) + ")");
    while (!tasks->empty()) finish_task(*tasks, tasks->begin()->first, why);
  });
  return {
      [self](atom::load, const LoadJob& job) -> caf::result<Status> {
        auto& st = self->state;
        // Each reader takes a contiguous stretch of the files, equal in bytes:
        // a few long sequential streams, and runs coalesce inside each.
        std::vector<ReadTask> tasks(std::min<size_t>(st.readers.size(), job.ops.size()));
        if (tasks.empty()) return Status();
        std::vector<ReadOp> ops = job.ops;
        std::sort(ops.begin(), ops.end(), [](const ReadOp& a, const ReadOp& b) {
          return std::tie(a.file, a.file_offset) < std::tie(b.file, b.file_offset);
        });
        uint64_t total = 0;
        for (const auto& op : ops) total += op.length;
        uint64_t seen = 0;
        for (auto& op : ops) {
          const size_t k =
              total ? std::min<size_t>(tasks.size() - 1, seen * tasks.size() / total) : 0;
          seen += op.length;
          tasks[k].ops.push_back(std::move(op));
        }
        auto load = std::make_shared<LoadInFlight>();
        load->rp = self->make_response_promise();
        for (const auto& t : tasks) load->left += t.ops.empty() ? 0 : 1;
        for (size_t i = 0; i < tasks.size(); ++i) {
          if (tasks[i].ops.empty()) continue;
          tasks[i].dir = job.dir;
          tasks[i].manifest = job.manifest;
          tasks[i].targets = job.targets;
          const uint64_t id = st.next_task++;
          st.tasks->emplace(id, ReaderTask{i, load});
          self->request(st.readers[i], caf::infinite, atom::read_v, std::move(tasks[i]))
              .then([self, id](const Status& s) { finish_task(*self->state.tasks, id, s); },
                    [self, id, i](caf::error& e) {
                      finish_task(*self->state.tasks, id,
                                  Status::internal("reader " + std::to_string(i) + ": " +
                                                   self->system().render(e)));
                    });
        }
        return load->rp;
      },
  };
}

}  // namespace

loader_actor spawn_loader(caf::actor_system& sys, ContextPtr ctx) {
  return sys.spawn(loader_fun, std::move(ctx));
}

}  // namespace ferry
