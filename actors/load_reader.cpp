// The reader actor: one task's reads, checks and copies, on a thread of its own (preads block).
//
// A reader packs its ops into aligned runs (make_read_runs), reads
// each run with one pread into a staging pool block (O_DIRECT where the
// filesystem takes it), queues its next runs on a thread of its own that
// reads them back to back, while it verifies the checksum blocks of the run
// that landed and copies the requested bytes into the caller's tensors
// through the device. The pool is
// bounded: a load larger than it streams through the same few blocks. A
// large op that fills a whole contiguous range of a host tensor the file's
// reads can write to (its alignment, read-into-tensors) skips the staging
// block: it is read straight into the tensor and verified there.

#include "actors/load_reader.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <thread>
#include <tuple>
#include <vector>

#include "actors/load_fetches.hpp"
#include "actors/load_share_send.hpp"
#include "actors/load_verify.hpp"
#include "checksum.hpp"
#include "codec.hpp"
#include "work_queue.hpp"

namespace ferry {

namespace {

// O_DIRECT wants buffers, offsets and lengths aligned to the logical block
// size; 4096 covers every device we run on (the writer assumes the same).
constexpr uint64_t kAlign = 4096;
// A reader's reads go to the disk one at a time, back to back, from a
// thread of their own, while the reader verifies and copies the runs that
// landed: at most kRunsHeld runs read or queued, in pool blocks. One 32 MiB
// pread is already a deep queue for the device (the kernel splits it into
// many requests), and more at once did not read faster: the virtual disk
// here shares its bandwidth between the reads it has and ends them together
// (8 reads of 32 MiB, 2 readers x 4, each took 35-50 ms and all ended
// within 0.3 ms). The readers then verified and copied the whole wave while
// the disk had nothing to do: 46-63 ms idle per 2 GiB load. A next read
// started only when the reader came back for it still left the disk idle
// whenever a run took longer to verify and copy than the next to read.
constexpr size_t kRunsHeld = 4;
// Threads of a reader for the rest: header checks beside the reads, and
// compressed chunks read and decoded this many at once.
constexpr size_t kPreadThreads = 4;
// Staged reads are at most this long (and at most a pool block). 8 MiB
// reads were 5-15% slower than 32 MiB ones on a disk reading 4.5 GB/s here
// (single rank, 120 tensors; two ranks, 2,000 tensors split by rows), and
// saved nothing once the pool's background faulting ran at normal priority:
// the pages a load does not fault, that thread does, at the same time.
constexpr uint64_t kStagedRunBytes = 32ull << 20;
// A reader's last 32 MiB go in reads of this: after the last read lands the
// disk has nothing to do while the reader checks and copies it, 5-10 ms per
// 32 MiB here (the most of a 2 GiB load's idle disk time).
constexpr uint64_t kTailRunBytes = 8ull << 20;

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
Status verify_header(File& f, const ManifestFile& mf, const std::string& path, uint64_t size) {
  if (mf.header_bytes == 0) return Status();
  // Memory for a header the file cannot hold is never taken.
  if (mf.header_bytes > size)
    return Status::corruption("file " + path + " is " + std::to_string(size) +
                              " bytes long, shorter than its safetensors header (" +
                              std::to_string(mf.header_bytes) + " bytes) in the manifest");
  const uint64_t len = (mf.header_bytes + kAlign - 1) / kAlign * kAlign;
  AlignedBuffer buf(len);
  if (!buf.p) return Status::internal("no memory for the header of file " + path);
  FERRY_ASSIGN_OR_RETURN(size_t got, f.pread(buf.p, len, 0));
  if (got < mf.header_bytes || xxh3_64(buf.p, mf.header_bytes) != mf.header_checksum)
    return Status::corruption("safetensors header of file " + path +
                              " does not match its checksum in the manifest");
  return Status();
}

// What a read straight into a caller's memory must respect: the alignment
// of the memory and of the file offset. O_DIRECT's come from statx
// (STATX_DIOALIGN, Linux 6.1; an NVMe drive takes any 4-byte aligned
// memory), else the 4096 the rest of the reader assumes; a buffered read
// takes any.
struct ReadAlign {
  uint64_t memory = 1, offset = 1;
};

ReadAlign direct_align(const std::string& path) {
  ReadAlign a{kAlign, kAlign};
#ifdef STATX_DIOALIGN
  struct statx sx {};
  if (::statx(AT_FDCWD, path.c_str(), 0, STATX_DIOALIGN, &sx) == 0 &&
      (sx.stx_mask & STATX_DIOALIGN) && sx.stx_dio_mem_align > 0 &&
      sx.stx_dio_mem_align <= kAlign && sx.stx_dio_offset_align > 0 &&
      sx.stx_dio_offset_align <= kAlign) {
    a.memory = sx.stx_dio_mem_align;
    a.offset = sx.stx_dio_offset_align;
  }
#endif
  return a;
}

// A data file as one reader uses it. `cache_fd` is a plain descriptor kept
// only to drop the pages a buffered read left in the page cache.
struct OpenFile {
  std::unique_ptr<File> file;
  std::string path;
  // Its length when opened: no read is sized past it (a manifest may claim
  // any length), whatever memory that read would take.
  uint64_t size = ~uint64_t{0};
  ReadAlign align;
  int cache_fd = -1;
  // The header's check runs on the pread threads beside the first data
  // reads, and a run's bytes are used only once it passed: done first and
  // alone, its small read would queue behind another reader's 32 MiB reads
  // and hold back this reader's first one.
  std::future<Result<size_t>> header;
  Status header_status;
  ~OpenFile() {
    if (cache_fd >= 0) ::close(cache_fd);
  }
};

// A read of the reader's list: a run into a staging block, or one op read
// straight into its tensor at `direct` (the run then holds that op alone and
// its length is what one aligned pread takes of it; the rest, less than an
// alignment unit, is read apart).
struct Work {
  ReadRun run;
  uint8_t* direct = nullptr;
};

// Ops smaller than this (or than a staging block, which bounds every op)
// share staged runs: one pread for many small tensors costs less than a
// pread each, and their copies are cheap.
constexpr uint64_t kDirectMinBytes = 1ull << 20;

// One run read or queued: the block it reads into and its outcome.
struct InFlight {
  const Work* work = nullptr;
  OpenFile* file = nullptr;
  std::optional<Lease> lease;
  std::unique_ptr<AlignedBuffer> heap;  // only for a run larger than a pool block
  uint8_t* buf = nullptr;
  std::future<Result<size_t>> got;
};

class RunReader {
 public:
  RunReader(const RankContext& ctx, ReadTask& task)
      : ctx_(ctx),
        task_(task),
        pause_(ctx.pool.get()),
        io_("ferry.pread", kPreadThreads, WorkQueue::AtStop::run_queued) {}
  // Every read started is waited for and every block released, whatever failed.
  ~RunReader() {
    while (!inflight_.empty()) {
      if (inflight_.front().got.valid()) inflight_.front().got.wait();
      // Read straight into its tensor and never checked: the load stopped first.
      if (inflight_.front().work->direct) unverified(inflight_.front().work->run.ops.front());
      release(inflight_.front());
      inflight_.pop_front();
    }
    for (auto& [index, f] : files_)
      if (f && f->header.valid()) f->header.wait();  // empty where an open failed
  }

  Status run() {
    const uint64_t block = ctx_.pool->block_bytes();
    std::vector<ReadOp> ops;
    std::vector<const ReadOp*> compressed;
    auto raw = [this](const ReadOp& op) {
      return task_.manifest->tensors[op.tensor].chunks[op.chunk].codec.empty();
    };
    if (std::all_of(task_.ops.begin(), task_.ops.end(), raw)) {
      ops = std::move(task_.ops);  // the usual case: not one op moved
    } else {
      ops.reserve(task_.ops.size());
      for (ReadOp& op : task_.ops) {
        if (raw(op))
          ops.push_back(std::move(op));
        else
          compressed.push_back(&op);
      }
    }
    FERRY_RETURN_IF_ERROR(read_compressed_ops(compressed));
    FERRY_RETURN_IF_ERROR(plan_work(std::move(ops), block));
    size_t next = 0;
    while (next < runs_.size() || !inflight_.empty()) {
      FERRY_RETURN_IF_ERROR(start_reads(next, block));
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
  // Queues reads of the next runs while the reader holds fewer than
  // kRunsHeld and the pool has room.
  Status start_reads(size_t& next, uint64_t block) {
    while (next < runs_.size() && inflight_.size() < kRunsHeld) {
      FERRY_ASSIGN_OR_RETURN(bool started, start(runs_[next], block));
      if (!started) break;
      ++next;
    }
    return Status();
  }

  // A file that fails to open leaves no entry behind (the destructor and
  // the end of run() walk every entry).
  Result<OpenFile*> open(uint32_t index) {
    if (auto it = files_.find(index); it != files_.end()) return it->second.get();
    auto f = std::make_unique<OpenFile>();
    f->path = join_path(task_.dir, task_.manifest->files[index].name);
    OpenOptions o;
    o.direct = ctx_.opts.direct_io;
    // Runs are large already; readahead would only leave pages behind.
    o.no_readahead = true;
    auto opened = ctx_.fs->open(f->path, o);
    if (!opened.ok())
      return opened.status().with_context("rank " + std::to_string(ctx_.rank) + ": data file: ");
    f->file = std::move(opened).value();
    if (auto info = ctx_.fs->stat(f->path); info.ok()) f->size = info->size;
    f->header = io_.submit([fp = f->file.get(), &mf = task_.manifest->files[index], path = f->path,
                            size = f->size]() -> Result<size_t> {
      FERRY_RETURN_IF_ERROR(verify_header(*fp, mf, path, size));
      return size_t{0};
    });
    if (f->file->direct())
      f->align = direct_align(f->path);
    else
      f->cache_fd = ::open(f->path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
    OpenFile* out = f.get();
    files_.emplace(index, std::move(f));
    return out;
  }

  // Where `op` can be read straight into its tensor, that tensor's bytes:
  // a large op that fills one contiguous host range whose address and file
  // offset the file's reads accept. The copy out of a staging block then
  // goes away, and on a fast disk that copy is what limits a load.
  uint8_t* direct_target(const ReadOp& op, const OpenFile& f, uint64_t block) const {
    if (op.entry == ReadOp::kForOthers) return nullptr;
    const TensorView& t = (*task_.targets)[op.entry];
    if (!ctx_.opts.read_into_tensors || op.length < std::min(kDirectMinBytes, block) ||
        !t.device.is_host() || !t.is_contiguous())
      return nullptr;
    int pieces = 0;
    bool whole = false;
    uint64_t at = 0;
    for_each_copy(op, dtype_size(t.dtype), [&](uint64_t src, uint64_t dst, uint64_t n) {
      ++pieces;
      whole = src == 0 && n == op.length;
      at = dst;
    });
    uint8_t* p = static_cast<uint8_t*>(t.data) + at;
    if (pieces != 1 || !whole || reinterpret_cast<uintptr_t>(p) % f.align.memory != 0 ||
        op.file_offset % f.align.offset != 0)
      return nullptr;
    return p;
  }

  // The reader's list, in file order: ops read straight into their tensors,
  // and runs of the others through staging blocks.
  Status plan_work(std::vector<ReadOp> ops, uint64_t block) {
    // The staged ops stay where they are, moved down over those read
    // straight into their tensors: at 10,000 small ops a copy of them all
    // was megabytes of fresh pages faulted in before the first read.
    size_t staged = 0;
    for (ReadOp& op : ops) {
      FERRY_ASSIGN_OR_RETURN(OpenFile * f, open(op.file));
      uint8_t* p = direct_target(op, *f, block);
      if (!p) {
        if (&ops[staged] != &op) ops[staged] = std::move(op);
        ++staged;
        continue;
      }
      const uint64_t head = op.length / f->align.offset * f->align.offset;
      runs_.push_back({ReadRun{op.file, op.file_offset, head, {std::move(op)}}, p});
    }
    ops.resize(staged);
    for (ReadRun& r : make_read_runs(std::move(ops), *task_.manifest,
                                     std::min(block, kStagedRunBytes), kAlign, kTailRunBytes))
      runs_.push_back({std::move(r), nullptr});
    std::stable_sort(runs_.begin(), runs_.end(), [](const Work& a, const Work& b) {
      return std::tie(a.run.file, a.run.offset) < std::tie(b.run.file, b.run.offset);
    });
    return Status();
  }

  // Starts the read of `w`; false when no staging block is free now.
  Result<bool> start(const Work& w, uint64_t block) {
    const ReadRun& run = w.run;
    InFlight f;
    f.work = &w;
    FERRY_ASSIGN_OR_RETURN(f.file, open(run.file));
    FERRY_RETURN_IF_ERROR(within(*f.file, run.ops));
    if (w.direct) {
      f.buf = w.direct;
    } else if (run.length <= block) {
      f.lease = ctx_.pool->try_acquire(StagingPool::Faulting::on_use);
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
    File* fp = f.file->file.get();
    f.got = disk_.submit([fp, buf = f.buf, &run, clocks = task_.clocks.get()] {
      if (!clocks) return fp->pread(buf, run.length, run.offset);
      const int64_t t0 = trace_now_ns();
      Result<size_t> got = fp->pread(buf, run.length, run.offset);
      clocks->read.add(t0, trace_now_ns(), got.ok() ? *got : 0);
      return got;
    });
    inflight_.push_back(std::move(f));
    return true;
  }

  Status finish(InFlight& f) {
    const ReadRun& run = f.work->run;
    const Manifest& m = *task_.manifest;
    const std::string& path = f.file->path;
    Result<size_t> got = f.got.get();
    Status read = got.ok() ? header_checked(*f.file) : got.status();
    if (!read.ok()) {
      if (f.work->direct) unverified(run.ops.front());
      return read;
    }
    ctx_.fs->crash_point("load.read");
    if (f.work->direct) return finish_direct(*f.file, run, f.work->direct, got.value());
    CopyLatch latch;
    Status s;
    for (const ReadOp& op : run.ops) {
      const uint64_t at = op.file_offset - run.offset;
      if (got.value() < at + op.length) {
        s = truncated(path, op);
        break;
      }
      const int64_t t0 = task_.clocks ? trace_now_ns() : 0;
      s = op.entry == ReadOp::kForOthers
              ? verify_blocks(ctx_, m, op, path, f.buf + at)
              : verify_and_copy(ctx_, m, op, path, f.buf + at, (*task_.targets)[op.entry], latch,
                                task_.unverified.get());
      if (task_.clocks) task_.clocks->verify.add(t0, trace_now_ns(), op.length);
      if (!s.ok()) break;
      // Every block of the op checked out: its bytes may go to other ranks.
      if (!op.share_with.empty() && task_.transport) {
        const int64_t t1 = task_.clocks ? trace_now_ns() : 0;
        s = send_shared(ctx_, task_, m, op, f.buf + at);
        if (task_.clocks) task_.clocks->share.add(t1, trace_now_ns(), op.length);
        if (!s.ok()) break;
      }
    }
    // Copies already started read from the block and report to the latch:
    // wait for them even when a later op failed.
    Status copied = latch.wait();
    FERRY_RETURN_IF_ERROR(s);
    FERRY_RETURN_IF_ERROR(copied);
    drop_cached(*f.file, run.offset, run.length);
    return Status();
  }

  // Ops that end past the file fail before their read takes memory.
  Status within(const OpenFile& f, const std::vector<ReadOp>& ops) const {
    for (const ReadOp& op : ops)
      if (op.file_offset + op.length > f.size) return truncated(f.path, op);
    return Status();
  }

  Status truncated(const std::string& path, const ReadOp& op) const {
    return Status::corruption("rank " + std::to_string(ctx_.rank) + ": file " + path +
                              " is truncated: tensor '" + task_.manifest->tensors[op.tensor].key +
                              "' needs bytes up to " + std::to_string(op.file_offset + op.length));
  }

  // A buffered read leaves the checkpoint in the page cache, where it would
  // push out what the job needs: drop the pages it read.
  static void drop_cached(const OpenFile& f, uint64_t offset, uint64_t length) {
    if (f.cache_fd >= 0)
      ::posix_fadvise(f.cache_fd, static_cast<off_t>(offset), static_cast<off_t>(length),
                      POSIX_FADV_DONTNEED);
  }

  // The op of `run` was read straight into its tensor at `p`, all but its
  // last partial alignment unit: read that apart, then check the checksums
  // in place. Bytes that fail them stay in the tensor (what a failed load
  // leaves in its targets is undefined anyway); the error names the block.
  Status finish_direct(OpenFile& f, const ReadRun& run, uint8_t* p, size_t got) {
    const ReadOp& op = run.ops.front();
    const Manifest& m = *task_.manifest;
    Status s = read_tail(f, run, p, got);
    const int64_t t0 = task_.clocks ? trace_now_ns() : 0;
    if (s.ok()) s = verify_blocks(ctx_, m, op, f.path, p);
    if (task_.clocks) task_.clocks->verify.add(t0, trace_now_ns(), op.length);
    if (!s.ok()) {
      unverified(op);
      return s;
    }
    if (!op.share_with.empty() && task_.transport) {
      const int64_t t1 = task_.clocks ? trace_now_ns() : 0;
      Status sent = send_shared(ctx_, task_, m, op, p);
      if (task_.clocks) task_.clocks->share.add(t1, trace_now_ns(), op.length);
      FERRY_RETURN_IF_ERROR(sent);
    }
    drop_cached(f, op.file_offset, op.length);
    return Status();
  }

  // The last partial alignment unit of a direct read's op, read apart.
  Status read_tail(OpenFile& f, const ReadRun& run, uint8_t* p, size_t got) {
    const ReadOp& op = run.ops.front();
    if (got < run.length) return truncated(f.path, op);
    if (run.length < op.length) {
      const uint64_t rest = op.length - run.length;
      AlignedBuffer tail(kAlign);
      if (!tail.p) return Status::internal("no memory for the end of a read of " + f.path);
      const uint64_t len = (rest + f.align.offset - 1) / f.align.offset * f.align.offset;
      FERRY_ASSIGN_OR_RETURN(size_t n, f.file->pread(tail.p, len, op.file_offset + run.length));
      if (n < rest) return truncated(f.path, op);
      std::memcpy(p + run.length, tail.p, rest);
    }
    return Status();
  }

  void unverified(const ReadOp& op) const {
    if (task_.unverified) task_.unverified->add(task_.manifest->tensors[op.tensor].key);
  }

  // A compressed chunk's frames are read, verified and decoded by the codec
  // on the pread threads, kPreadThreads ops at once (decoding is CPU work
  // that would otherwise stall the next read), then copied like raw bytes,
  // in order, on this thread. Every op started is waited for, whatever
  // failed: the threads use this reader's files.
  Status read_compressed_ops(const std::vector<const ReadOp*>& ops) {
    struct Decoding {
      const ReadOp* op;
      std::shared_ptr<std::vector<uint8_t>> raw;
      std::future<Result<size_t>> done;
    };
    std::deque<Decoding> q;
    Status first;
    size_t next = 0;
    while (next < ops.size() || !q.empty()) {
      while (first.ok() && next < ops.size() && q.size() < kPreadThreads) {
        const ReadOp* op = ops[next++];
        auto file = open(op->file);
        if (!file.ok()) {
          first = file.status();
          break;
        }
        const ManifestChunk& c = task_.manifest->tensors[op->tensor].chunks[op->chunk];
        if (c.byte_offset + c.byte_length > file.value()->size) {
          first = Status::corruption(
              "rank " + std::to_string(ctx_.rank) + ": file " + file.value()->path +
              " is truncated: tensor '" + task_.manifest->tensors[op->tensor].key +
              "' needs bytes up to " + std::to_string(c.byte_offset + c.byte_length));
          break;
        }
        auto raw = std::make_shared<std::vector<uint8_t>>();
        q.push_back(
            {op, raw,
             io_.submit([f = file.value(), m = task_.manifest, op, raw]() -> Result<size_t> {
               FERRY_RETURN_IF_ERROR(read_compressed(*f->file, f->path, *m, *op, raw.get()));
               return raw->size();
             })});
      }
      if (q.empty()) break;
      Decoding d = std::move(q.front());
      q.pop_front();
      Result<size_t> got = d.done.get();
      if (!first.ok()) continue;
      if (!got.ok()) {
        first = got.status().with_context("rank " + std::to_string(ctx_.rank) + ": ");
        continue;
      }
      first = header_checked(*files_.at(d.op->file));
      if (!first.ok()) continue;
      CopyLatch latch;
      const TensorView& target = (*task_.targets)[d.op->entry];
      std::vector<DeviceBackend::Run> runs;
      for_each_copy(*d.op, dtype_size(target.dtype), [&](uint64_t src, uint64_t dst, uint64_t n) {
        runs.push_back({src, dst, n});
      });
      copy_runs(ctx_, task_.manifest->tensors[d.op->tensor].key, d.raw->data(), target, runs,
                latch);
      first = latch.wait();
    }
    return first;
  }

  // The outcome of `f`'s header check, waited for the first time.
  static Status header_checked(OpenFile& f) {
    if (f.header.valid()) f.header_status = f.header.get().status();
    return f.header_status;
  }

  void release(InFlight& f) {
    if (f.lease) (void)ctx_.pool->release(*f.lease);  // fails only for a stale lease
    f.lease.reset();
  }

  const RankContext& ctx_;
  ReadTask& task_;  // its ops are moved out as they are planned
  StagingPool::PrefaultPause pause_;
  std::vector<Work> runs_;
  // Declared before the threads, so they end first: a decode still running
  // when an exception unwinds the reader uses its file.
  std::map<uint32_t, std::unique_ptr<OpenFile>> files_;
  // Both outlive no read: the destructor waits for every one first.
  WorkQueue disk_{"ferry.disk", 1, WorkQueue::AtStop::run_queued};  // the runs' reads, in order
  WorkQueue io_;
  std::deque<InFlight> inflight_;
  std::optional<std::chrono::steady_clock::time_point> waiting_since_;
};

// The pieces another host's reader sends this rank whole (load-sharing =
// job), in order: each waited for, its blocks checked against the manifest
// and copied as if read here, then shared with this node's ranks.
Status run_fetched(const RankContext& ctx, ReadTask& task) {
  const Manifest& m = *task.manifest;
  for (const ReadOp& op : task.ops) {
    FERRY_ASSIGN_OR_RETURN(const uint8_t* buf, task.fetches->wait(op, ctx.opts.write_timeout_s));
    const std::string path = join_path(task.dir, m.files[op.file].name) + " (sent by rank " +
                             std::to_string(op.fetch_from) + ")";
    CopyLatch latch;
    Status s = op.entry == ReadOp::kForOthers
                   ? verify_blocks(ctx, m, op, path, buf)
                   : verify_and_copy(ctx, m, op, path, buf, (*task.targets)[op.entry], latch,
                                     task.unverified.get());
    if (s.ok() && !op.share_with.empty() && task.transport) s = send_shared(ctx, task, m, op, buf);
    Status copied = latch.wait();
    task.fetches->release(op);
    FERRY_RETURN_IF_ERROR(s);
    FERRY_RETURN_IF_ERROR(copied);
  }
  return Status();
}

Status run_reads(reader_state& st, ReadTask& task) {
  // Sizes come from the manifest, capped by what the files hold; memory
  // that still runs out fails the load with a message, not the reader.
  try {
    if (task.fetches) return run_fetched(*st.ctx, task);
    RunReader reader(*st.ctx, task);
    return reader.run();
  } catch (const std::bad_alloc&) {
    return Status::internal("rank " + std::to_string(st.ctx->rank) +
                            ": out of memory reading the data files of " + task.dir);
  }
}

}  // namespace

reader_actor::behavior_type reader_fun(reader_actor::stateful_pointer<reader_state> self,
                                       ContextPtr ctx) {
  self->state.ctx = std::move(ctx);
  return {
      [self](atom::read, ReadTask& task) -> Status { return run_reads(self->state, task); },
  };
}

}  // namespace ferry
