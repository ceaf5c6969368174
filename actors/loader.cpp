// Loader and readers. The loader splits a load plan over the readers and
// gathers their outcomes (a reader that dies fails its part, it never hangs
// the load). A reader packs its ops into aligned runs (make_read_runs), reads
// each run with one pread into a staging pool block (O_DIRECT where the
// filesystem takes it), queues its next runs on a thread of its own that
// reads them back to back, while it verifies the checksum blocks of the run
// that landed and copies the requested bytes into the caller's tensors
// through the device. The pool is
// bounded: a load larger than it streams through the same few blocks. A
// large op that fills a whole contiguous range of a host tensor the file's
// reads can write to (its alignment, read-into-tensors) skips the staging
// block: it is read straight into the tensor and verified there.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <system_error>
#include <thread>
#include <tuple>

#include "actors/loader_actor.hpp"
#include "actors/messages.hpp"
#include "checksum.hpp"
#include "codec.hpp"
#include "copy_bytes.hpp"
#include "cpus.hpp"
#include "populate.hpp"
#include "work_queue.hpp"

namespace ferry {

// A load's tensors into which bytes landed that did not pass their checksum:
// a block copied and summed in one pass, or read straight into its tensor,
// whose sum then failed or was never taken because the load stopped first.
// A failed load names them (the others hold only checked bytes, old or new).
class UnverifiedTensors {
 public:
  void add(const std::string& key) {
    std::lock_guard<std::mutex> l(mu_);
    keys_.insert(key);
  }
  // `s` with the tensors named, at most kShown of them.
  Status name_in(const Status& s) const {
    std::lock_guard<std::mutex> l(mu_);
    if (s.ok() || keys_.empty()) return s;
    constexpr size_t kShown = 8;
    std::string list;
    size_t i = 0;
    for (const std::string& k : keys_) {
      if (i++ == kShown) break;
      list += (list.empty() ? "'" : ", '") + k + "'";
    }
    if (keys_.size() > kShown) list += " and " + std::to_string(keys_.size() - kShown) + " more";
    return Status(s.code(), s.message() + " (unverified bytes were left in tensor" +
                                (keys_.size() > 1 ? "s " : " ") + list + ")");
  }

 private:
  mutable std::mutex mu_;
  std::set<std::string> keys_;
};

// The pieces of one load that a reader of another node reads from storage
// and sends whole to this rank (load-sharing = job). The loader lands their
// frames as they come, so a sender's window never waits on this rank's
// readers (which may wait on that sender in turn); the fetching reader waits
// for each piece whole, then checks its blocks against the manifest as if
// it had read them. A piece's memory is taken at its first frame and given
// back once its reader is done with it.
class Fetches {
 public:
  Fetches(int32_t me, std::shared_ptr<Transport> transport)
      : me_(me), transport_(std::move(transport)) {}

  void add(const ReadOp& op) {
    std::lock_guard<std::mutex> l(mu_);
    Piece& p = pieces_[{op.file, op.file_offset}];
    p.from = op.fetch_from;
    p.length = op.length;
    senders_.insert(op.fetch_from);
    last_ = Clock::now();
  }
  bool sends(int32_t rank) const {
    std::lock_guard<std::mutex> l(mu_);
    return senders_.count(rank) > 0;
  }
  Transport* transport() const { return transport_.get(); }

  // A frame from `msg.from`: copied into its piece once its sum checked out.
  Status land(const BlockShareMsg& msg) {
    const uint64_t len = msg.length();
    const std::string what = "bytes " + std::to_string(msg.offset) + "+" + std::to_string(len) +
                             " of file #" + std::to_string(msg.file) + " from rank " +
                             std::to_string(msg.from) + " (another host)";
    std::lock_guard<std::mutex> l(mu_);
    if (!ended_.ok()) return ended_;
    auto it = pieces_.upper_bound({msg.file, msg.offset});
    if (it == pieces_.begin())
      return Status::corruption("rank " + std::to_string(me_) + ": unexpected " + what);
    --it;
    Piece& p = it->second;
    const uint64_t at = msg.offset - it->first.second;
    if (it->first.first != msg.file || p.from != msg.from || msg.ring_length != 0 || len == 0 ||
        at > p.length || len > p.length - at || p.got + len > p.length)
      return Status::corruption("rank " + std::to_string(me_) + ": unexpected " + what);
    if (!p.failed.ok()) return p.failed;
    if (!p.buf) {
      p.buf.reset(new (std::nothrow) uint8_t[p.length]);
      if (!p.buf)
        return Status::internal("rank " + std::to_string(me_) + ": no memory for " +
                                std::to_string(p.length) + " bytes fetched from rank " +
                                std::to_string(p.from));
    }
    if (xxh3_64_copy(p.buf.get() + at, msg.data.data(), len) != msg.checksum)
      return Status::corruption("rank " + std::to_string(me_) + ": " + what +
                                " do not match their checksum");
    p.got += len;
    last_ = Clock::now();
    if (p.got == p.length) cv_.notify_all();
    return Status();
  }

  // Waits until `op`'s piece landed whole: its bytes, valid until release().
  // Fails when its sender failed, or no bytes landed for `idle_s` (a sender
  // reads what it sends from storage first: idle is measured over them all).
  Result<const uint8_t*> wait(const ReadOp& op, double idle_s) {
    std::unique_lock<std::mutex> l(mu_);
    auto it = pieces_.find({op.file, op.file_offset});
    if (it == pieces_.end())
      return Status::internal("rank " + std::to_string(me_) + ": no fetched piece at " +
                              std::to_string(op.file_offset) + " of file #" +
                              std::to_string(op.file));
    Piece& p = it->second;
    const auto limit =
        std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(idle_s));
    for (;;) {
      if (!ended_.ok()) return ended_;
      if (!p.failed.ok()) return p.failed;
      if (p.got == p.length) return static_cast<const uint8_t*>(p.buf.get());
      if (Clock::now() - last_ >= limit)
        return Status::timeout("rank " + std::to_string(me_) + ": no bytes from rank " +
                               std::to_string(p.from) +
                               " (another host), which reads shared bytes for this host, "
                               "within write-timeout (" +
                               std::to_string(idle_s) + " s)");
      cv_.wait_until(l, last_ + limit);
    }
  }
  void release(const ReadOp& op) {
    std::lock_guard<std::mutex> l(mu_);
    if (auto it = pieces_.find({op.file, op.file_offset}); it != pieces_.end())
      it->second.buf.reset();
  }

  // `rank` failed (`why` names it): the pieces it owes fail.
  void fail(int32_t rank, const Status& why) {
    std::lock_guard<std::mutex> l(mu_);
    for (auto& [at, p] : pieces_)
      if (p.from == rank && p.got < p.length && p.failed.ok()) p.failed = why;
    cv_.notify_all();
  }
  // The load ended here (`why`, or ok when it succeeded): waits end, memory
  // goes, and (on a failure) every sender that still owes bytes is told to
  // stop; later frames are refused.
  void end(const RankContext& ctx, const std::string& load_id, const Status& why) {
    std::map<int32_t, bool> owing;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!ended_.ok()) return;
      ended_ = why.ok() ? Status::aborted("rank " + std::to_string(me_) + ": the load ended") : why;
      for (auto& [at, p] : pieces_) {
        if (p.got < p.length) owing[p.from] = true;
        p.buf.reset();
      }
      cv_.notify_all();
    }
    if (!transport_) return;
    for (const auto& [from, yes] : owing)
      (void)transport_->send(
          transport_->next_hop(from),
          encode_message(ShareAckMsg{ctx.job_id, load_id, me_, from, 0, ended_}));
  }
  bool ended() const {
    std::lock_guard<std::mutex> l(mu_);
    return !ended_.ok();
  }

 private:
  using Clock = std::chrono::steady_clock;
  struct Piece {
    int32_t from = -1;
    uint64_t length = 0, got = 0;
    std::unique_ptr<uint8_t[]> buf;
    Status failed;
  };
  const int32_t me_;
  std::shared_ptr<Transport> transport_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<uint32_t, uint64_t>, Piece> pieces_;  // by (file, offset)
  std::set<int32_t> senders_;
  Clock::time_point last_;  // when bytes last landed (or the load began)
  Status ended_;
};

namespace {

std::atomic<const std::function<void()>*> g_share_checked{nullptr};

void share_checked() {
  if (const auto* hook = g_share_checked.load(std::memory_order_acquire)) (*hook)();
}

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

// readers = auto (0): one reader where this process may run on at most 2
// CPUs, else 2. Each reader checks and copies what it reads; two of them
// keep both CPUs of a 2-CPU VM busy, and its virtual disk, which moves the
// data with CPU time of the same VM, then reads slower: a raw reader of
// 2 GiB beside one busy thread ran at 0.9-1.1x its speed alone, beside two
// at 0.6-0.7x, even at nice 19. One reader there: load / raw 0.895-0.922
// against 0.879-0.900 for two (the mean of 6-12 interleaved runs each, three
// sets), at 0.31 against 0.36 CPU-s per 2 GiB load.
uint32_t load_readers(uint32_t setting) {
  if (setting > 0) return setting;
  return usable_cpus() <= 2 ? 1 : 2;
}

struct reader_state {
  static inline const char* name = "ferry.reader";
  ContextPtr ctx;
};

// Checks the sum of checksum block `i` of one read; the error names rank,
// tensor and file.
Status check_block(const RankContext& ctx, const Manifest& m, const ReadOp& op,
                   const std::string& path, uint32_t i, uint64_t sum) {
  const ManifestChunk& c = m.tensors[op.tensor].chunks[op.chunk];
  const uint32_t block = op.first_block + i;
  if (block >= c.checksums.size() || sum != c.checksums[block])
    return Status::corruption("rank " + std::to_string(ctx.rank) +
                              ": checksum mismatch in tensor '" + m.tensors[op.tensor].key +
                              "' (chunk " + c.entry + ", block " + std::to_string(block) +
                              ") of file " + path);
  return Status();
}

// Verifies checksum block `i` of one read (at `buf`, the read's first byte).
Status verify_block(const RankContext& ctx, const Manifest& m, const ReadOp& op,
                    const std::string& path, const uint8_t* buf, uint32_t i) {
  const uint64_t begin = static_cast<uint64_t>(i) * m.checksum_block_bytes;
  const uint64_t n = std::min<uint64_t>(m.checksum_block_bytes, op.length - begin);
  return check_block(ctx, m, op, path, i, xxh3_64(buf + begin, n));
}

// Verifies every checksum block of one read (a chunk saved without
// checksums has none to check).
Status verify_blocks(const RankContext& ctx, const Manifest& m, const ReadOp& op,
                     const std::string& path, const uint8_t* buf) {
  if (m.tensors[op.tensor].chunks[op.chunk].checksums.empty()) return Status();
  for (uint32_t i = 0; i < op.nblocks; ++i)
    FERRY_RETURN_IF_ERROR(verify_block(ctx, m, op, path, buf, i));
  return Status();
}

// One receiver's part of a read being sent: the runs of its shared stream
// in the read buffer, and how far they have gone.
struct OutStream {
  const ShareTo* to = nullptr;
  std::vector<std::pair<uint64_t, uint64_t>> runs;  // (offset in the buffer, bytes)
  size_t run = 0;  // the next byte to send: runs[run], `into` bytes in
  uint64_t into = 0;
};

// The sum of a frame's bytes, which lie in `parts`, `n` bytes in all.
uint64_t sum_parts(const std::vector<std::string_view>& parts, uint64_t n,
                   StreamingChecksum& hash) {
  if (parts.size() == 1) return xxh3_64(parts.front().data(), n);
  hash.reset();
  for (std::string_view p : parts) hash.update(p.data(), p.size());
  return hash.digest();
}

void copy_parts(uint8_t* into, const std::vector<std::string_view>& parts) {
  for (std::string_view p : parts) {
    copy_bytes(into, p.data(), p.size());
    into += p.size();
  }
}

// Gathers a frame's parts into `into` and returns their sum, hashing every
// slice of the frame right after it was copied: the hash then reads bytes
// the copy left in the core's cache, where summing the parts first read
// them from memory twice (the read buffer left the cache since the block
// was verified). One part (rows) is summed as it is copied.
uint64_t copy_and_sum(uint8_t* into, const std::vector<std::string_view>& parts,
                      StreamingChecksum& hash) {
  if (parts.size() == 1) return xxh3_64_copy(into, parts[0].data(), parts[0].size());
  constexpr uint64_t kSlice = 128 << 10;
  hash.reset();
  uint8_t* hashed = into;
  for (std::string_view p : parts) {
    for (uint64_t at = 0; at < p.size();) {
      const uint64_t k = std::min<uint64_t>(p.size() - at, kSlice);
      copy_bytes(into, p.data() + at, k);
      into += k;
      at += k;
      if (static_cast<uint64_t>(into - hashed) >= kSlice) {
        hash.update(hashed, static_cast<size_t>(into - hashed));
        hashed = into;
      }
    }
  }
  hash.update(hashed, static_cast<size_t>(into - hashed));
  return hash.digest();
}

// Sends the verified bytes of `op` (at `buf`) to the ranks in op.share_with,
// each only the elements of its box (its shared stream), in frames that
// carry their own checksum: the receiver cannot check part of a checksum
// block against the manifest. A frame's bytes are one stretch of the
// stream, copied from the buffer into the frame once, from wherever they lie
// (together for rows, apart for columns). The receivers' frames take turns, so all of them
// progress together. Each frame waits for room in the window toward its
// receiver (ShareWindows): the reader thread blocks there, and no queue
// grows past the windows.
Status send_shared(const RankContext& ctx, const ReadTask& task, const Manifest& m,
                   const ReadOp& op, const uint8_t* buf) {
  Transport& t = *task.transport;
  const std::string& load_id = task.load_id;
  const uint64_t window = ctx.opts.share_window_bytes;
  const uint64_t step = share_frame_bytes(window);
  const size_t es = dtype_size(m.tensors[op.tensor].dtype);
  std::vector<OutStream> streams;
  for (const ShareTo& to : op.share_with) {
    OutStream o;
    o.to = &to;
    // Another host's reader takes the read whole and checks its blocks.
    if (to.raw) o.runs.emplace_back(0, op.length);
    if (!to.raw)
      for_each_shared_run(op, to.box, es, [&o](uint64_t src, uint64_t, uint64_t n) {
        if (!o.runs.empty() && o.runs.back().first + o.runs.back().second == src)
          o.runs.back().second += n;
        else
          o.runs.emplace_back(src, n);
      });
    if (!o.runs.empty()) streams.push_back(std::move(o));
  }
  std::vector<std::string_view> parts;  // one frame's bytes in the buffer, in stream order
  StreamingChecksum hash;
  // Receivers of a replicated tensor take the same frames: one sum serves
  // all. The frame last summed: whose box, from where.
  const Box* summed_box = nullptr;
  size_t summed_run = 0;
  uint64_t summed_into = 0, sum = 0;
  for (bool more = true; more;) {
    more = false;
    for (OutStream& o : streams) {
      if (o.run == o.runs.size()) continue;
      more = true;
      const size_t run = o.run;
      const uint64_t into = o.into;
      // The next frame: up to `step` bytes of the stream, the cursor past them.
      parts.clear();
      uint64_t n = 0;
      while (n < step && o.run < o.runs.size()) {
        const uint64_t k = std::min(step - n, o.runs[o.run].second - o.into);
        parts.emplace_back(reinterpret_cast<const char*>(buf + o.runs[o.run].first + o.into), k);
        n += k;
        o.into += k;
        if (o.into == o.runs[o.run].second) {
          ++o.run;
          o.into = 0;
        }
      }
      const bool summed = summed_box && *summed_box == o.to->box && !o.to->raw &&
                          summed_run == run && summed_into == into;
      summed_box = o.to->raw ? nullptr : &o.to->box;
      summed_run = run;
      summed_into = into;
      const int32_t to = o.to->rank;
      auto context = [&] {
        return "rank " + std::to_string(ctx.rank) + ": sending bytes of tensor '" +
               m.tensors[op.tensor].key + "' to rank " + std::to_string(to) + ": ";
      };
      // A ring's lock is held until the frame went: frames leave in the
      // order they take its room.
      PeerRings::Lease ring = task.peer_rings ? task.peer_rings->get(to) : PeerRings::Lease{};
      Status s = ctx.shares->acquire(load_id, to, n, window, ctx.opts.write_timeout_s);
      if (!s.ok()) return s.with_context(context());
      const uint64_t first =
          static_cast<uint64_t>(reinterpret_cast<const uint8_t*>(parts.front().data()) - buf);
      BlockShareMsg msg{ctx.job_id, load_id, ctx.rank, to, op.file, op.file_offset + first,
                        Status(),   {},      0};
      // Straight to `to` over a direct lane, else through rank 0, which
      // passes it on by BlockShare.to: the bytes in its ring, else gathered
      // straight into the frame.
      if (ring.ring != nullptr) {
        msg.ring_offset = ring.ring->place(n);
        msg.ring_length = n;
        uint8_t* frame = ring.ring->at(msg.ring_offset);
        if (!summed)
          sum = copy_and_sum(frame, parts, hash);
        else
          copy_parts(frame, parts);
        msg.checksum = sum;
        s = t.send(t.next_hop(to), encode_message(msg, ctx.frames.get()));
        if (s.ok()) ctx.shares->count_in_memory(n);
      } else {
        if (!summed) sum = sum_parts(parts, n, hash);
        msg.checksum = sum;
        s = t.send(t.next_hop(to), encode_gathered(msg, parts, ctx.frames.get()));
      }
      if (!s.ok()) return s.with_context(context());
    }
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

// Copies `runs` (offsets past `src`) into `target` through the device, one
// batch; the batch reports to `latch`. `key` outlives the latch's wait.
void copy_runs(const RankContext& ctx, const std::string& key, const uint8_t* src,
               const TensorView& target, const std::vector<DeviceBackend::Run>& runs,
               CopyLatch& latch) {
  if (runs.empty()) return;
  latch.add();
  ctx.device->copy_in_runs(src, target, runs, [&latch, &key](Status st) {
    // The device names itself and the CUDA error; only we know the tensor.
    if (!st.ok()) st = st.with_context("tensor '" + key + "': ");
    latch.arrive(std::move(st));
  });
}

// Verifies the checksum blocks of one read (at `buf`) and copies its bytes
// into `target`, a block at a time: the copy reads each block while the hash
// has just left it in the CPU's cache, which saved a sixth of the time of
// hashing all and then copying all (2 GiB, measured here). A block that goes
// whole to one stretch of the tensor is copied and summed in one pass where
// the device can (copy_in_summed: 0.115 against 0.145 s per 2 GiB here): its
// bytes land before they are checked, and a mismatch fails the load as
// before (a failed load leaves its tensors partly loaded either way). Any
// other byte reaches the tensor only after its block checked out. Copies
// started report to `latch`.
Status verify_and_copy(const RankContext& ctx, const Manifest& m, const ReadOp& op,
                       const std::string& path, const uint8_t* buf, const TensorView& target,
                       CopyLatch& latch, UnverifiedTensors* unverified) {
  const bool checked = !m.tensors[op.tensor].chunks[op.chunk].checksums.empty();
  const uint64_t cb = checked ? m.checksum_block_bytes : op.length;
  uint64_t verified = checked ? 0 : op.length;  // bytes of the read checked so far
  Status s;
  const std::string& key = m.tensors[op.tensor].key;
  // The copies out of the blocks checked so far, issued as one batch before
  // the next block is hashed.
  std::vector<DeviceBackend::Run> runs;
  auto verify_to = [&](uint64_t end) {
    copy_runs(ctx, key, buf, target, runs, latch);
    runs.clear();
    while (s.ok() && verified < end) {
      s = verify_block(ctx, m, op, path, buf, static_cast<uint32_t>(verified / cb));
      verified = std::min(op.length, verified + cb);
    }
  };
  for_each_copy(op, dtype_size(target.dtype), [&](uint64_t src, uint64_t dst, uint64_t n) {
    while (n > 0 && s.ok()) {
      const uint64_t block_end = std::min(op.length, verified + cb);
      if (checked && src == verified && n >= block_end - src) {
        const uint64_t k = block_end - src;
        if (auto sum = ctx.device->copy_in_summed(buf + src, target, dst, k)) {
          s = check_block(ctx, m, op, path, static_cast<uint32_t>(src / cb), *sum);
          if (!s.ok() && unverified) unverified->add(key);
          verified = block_end;
          src += k;
          dst += k;
          n -= k;
          continue;
        }
      }
      if (src >= verified) verify_to(src + 1);
      if (!s.ok()) return;
      const uint64_t k = std::min(n, verified - src);
      runs.push_back({src, dst, k});
      src += k;
      dst += k;
      n -= k;
    }
  });
  verify_to(op.length);
  return s;
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
    for (ReadOp& op : task_.ops) {
      if (task_.manifest->tensors[op.tensor].chunks[op.chunk].codec.empty())
        ops.push_back(std::move(op));
      else
        compressed.push_back(&op);
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
    const TensorView& t = task_.targets[op.entry];
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
    std::vector<ReadOp> staged;
    for (ReadOp& op : ops) {
      FERRY_ASSIGN_OR_RETURN(OpenFile * f, open(op.file));
      uint8_t* p = direct_target(op, *f, block);
      if (!p) {
        staged.push_back(std::move(op));
        continue;
      }
      const uint64_t head = op.length / f->align.offset * f->align.offset;
      runs_.push_back({ReadRun{op.file, op.file_offset, head, {std::move(op)}}, p});
    }
    for (ReadRun& r : make_read_runs(std::move(staged), *task_.manifest,
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
              : verify_and_copy(ctx_, m, op, path, f.buf + at, task_.targets[op.entry], latch,
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
      const TensorView& target = task_.targets[d.op->entry];
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
                   : verify_and_copy(ctx, m, op, path, buf, task.targets[op.entry], latch,
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

reader_actor::behavior_type reader_fun(reader_actor::stateful_pointer<reader_state> self,
                                       ContextPtr ctx) {
  self->state.ctx = std::move(ctx);
  return {
      [self](atom::read, ReadTask& task) -> Status { return run_reads(self->state, task); },
  };
}

// One load in flight: its promise and how many reader tasks are still out
// (the bytes other ranks send count as one more task).
struct LoadInFlight {
  caf::response_promise rp;
  size_t left = 0;
  Status first_error;
  // Ranks this rank reads shared bytes for: told once should its reads fail.
  std::vector<int32_t> receivers;
  std::string load_id;
  std::shared_ptr<Transport> transport;
  std::shared_ptr<UnverifiedTensors> unverified = std::make_shared<UnverifiedTensors>();
  std::shared_ptr<Fetches> fetches;  // load-sharing = job: what other hosts send
};

// A read task handed to a reader (or the share wait of a load) not yet answered.
struct ReaderTask {
  size_t reader = 0;  // kNoReader for the share wait
  std::shared_ptr<LoadInFlight> load;
};
constexpr size_t kNoReader = ~size_t{0};

using ReaderTasks = std::map<uint64_t, ReaderTask>;

// The pieces of one load that other ranks of this node read for this rank.
struct ShareWait {
  uint64_t task = 0;
  std::shared_ptr<const Manifest> manifest;
  std::vector<TensorView> targets;
  std::vector<std::pair<int32_t, ReadOp>> pieces;  // by (file, file_offset)
  std::map<int32_t, uint64_t> owed;                // bytes each reader has yet to send
  std::chrono::steady_clock::time_point last;      // when bytes last arrived
  std::shared_ptr<Transport> transport;            // acks go back on it
  std::shared_ptr<const ShareRing> ring;           // where ring frames' bytes lie
  std::shared_ptr<UnverifiedTensors> unverified;   // the load's
  // Ring frames are copied here before they are checked and used.
  std::unique_ptr<uint8_t[]> scratch;
  uint64_t scratch_bytes = 0;
};

// Tells the sender of shared bytes what this rank took (flow control), or,
// with an error, that it takes no more bytes of the load.
void send_ack(const RankContext& ctx, Transport& t, const std::string& load_id, int32_t sender,
              uint64_t bytes, const Status& status) {
  Status s =
      t.send(t.next_hop(sender),
             encode_message(ShareAckMsg{ctx.job_id, load_id, ctx.rank, sender, bytes, status}));
  // A sender that is gone needs no ack; its failure reaches the load anyway.
  if (!s.ok())
    log_printf(ctx.log, LogLevel::warning, "ferry[rank %d]: no ShareAck to rank %d: %s", ctx.rank,
               sender, s.to_string().c_str());
}

// Every load is answered exactly once, whatever dies: a reader's reply, its
// death and the loader's own end each finish a task at most once.
//
//   idle --load--> reading --every task answered, or its reader died--> idle
//
// Shared bytes: a load's share wait ends when every piece arrived, a sender
// reported its failure, a piece failed its checks, or no bytes came for
// write-timeout. Bytes that come before their load are kept until it does.
struct loader_state {
  static inline const char* name = "ferry.loader";
  ContextPtr ctx;
  std::vector<reader_actor> readers;
  uint64_t next_task = 0;
  // Shared with the functor that answers what is left when the loader ends.
  std::shared_ptr<ReaderTasks> tasks = std::make_shared<ReaderTasks>();
  std::map<std::string, ShareWait> shares;                  // by load id
  std::map<std::string, std::vector<BlockShareMsg>> early;  // by load id
  std::deque<std::string> ended;  // the last few share waits that ended: late bytes are dropped
  // load-sharing = job: by load id, what other hosts send this rank whole,
  // and the reader that waits for it (after the storage readers in `readers`).
  std::map<std::string, std::shared_ptr<Fetches>> fetches;
  size_t storage_readers = 0;
};

using loader_ptr = loader_actor::stateful_pointer<loader_state>;

// A load whose own reads failed tells the ranks waiting for its bytes, so
// they fail at once, naming it, instead of at their deadline.
void tell_receivers(const RankContext& ctx, LoadInFlight& load, const Status& why) {
  if (!load.transport) return;
  for (int32_t to : load.receivers)
    (void)load.transport->send(
        load.transport->next_hop(to),
        encode_message(BlockShareMsg{ctx.job_id, load.load_id, ctx.rank, to, 0, 0, why, ""}));
  load.receivers.clear();
}

void finish_task(const RankContext& ctx, ReaderTasks& tasks, uint64_t id, Status s) {
  auto it = tasks.find(id);
  if (it == tasks.end()) return;
  auto load = std::move(it->second.load);
  const bool reads = it->second.reader != kNoReader;
  tasks.erase(it);
  if (!s.ok() && reads) {
    tell_receivers(ctx, *load, s);
    // The load failed here: its other readers stop sending at once.
    if (!load->load_id.empty()) ctx.shares->close(load->load_id, s);
  }
  // A failed load waits for nothing more from other hosts.
  if (!s.ok() && load->fetches) load->fetches->end(ctx, load->load_id, s);
  if (!s.ok() && load->first_error.ok()) load->first_error = std::move(s);
  if (--load->left == 0) {
    if (load->fetches) load->fetches->end(ctx, load->load_id, load->first_error);
    if (!load->load_id.empty()) ctx.shares->close(load->load_id, load->first_error);
    load->rp.deliver(load->unverified->name_in(load->first_error));
  }
}

// Checks one frame of shared bytes against its sum and copies it into the
// tensors of every piece it belongs to (in one pass where it goes to one
// stretch of one tensor). Errors name the sending rank.
Status take_share(const RankContext& ctx, ShareWait& w, const BlockShareMsg& msg) {
  const std::string sender = "rank " + std::to_string(msg.from);
  if (!msg.status.ok())
    return msg.status.with_context(sender + " failed to read bytes rank " +
                                   std::to_string(ctx.rank) + " needs from it: ");
  const Manifest& m = *w.manifest;
  const uint64_t len = msg.length();
  const std::string what =
      "bytes " + std::to_string(msg.offset) + "+" + std::to_string(len) + " of file " +
      (msg.file < m.files.size() ? m.files[msg.file].name : "#" + std::to_string(msg.file)) +
      " from " + sender;
  auto owed = w.owed.find(msg.from);
  if (len == 0 || owed == w.owed.end() || owed->second < len)
    return Status::corruption("rank " + std::to_string(ctx.rank) + ": unexpected " + what);
  const auto* data = msg.ring_length == 0
                         ? reinterpret_cast<const uint8_t*>(msg.data.data())
                         : (w.ring ? w.ring->frame(msg.from, msg.ring_offset, len) : nullptr);
  if (data == nullptr)
    return Status::corruption("rank " + std::to_string(ctx.rank) + ": " + what + " lie at " +
                              std::to_string(msg.ring_offset) +
                              " of its share ring, outside that rank's region");
  auto mismatch = [&] {
    return Status::corruption("rank " + std::to_string(ctx.rank) + ": " + what +
                              " do not match their checksum");
  };
  // The pieces holding the frame: the last starting at or before it, and any
  // others with the same range (two entries reading the same bytes).
  auto key = [](const std::pair<int32_t, ReadOp>& p) {
    return std::make_pair(p.second.file, p.second.file_offset);
  };
  auto it = std::upper_bound(
      w.pieces.begin(), w.pieces.end(), std::make_pair(msg.file, msg.offset),
      [&](const std::pair<uint32_t, uint64_t>& v, const auto& p) { return v < key(p); });
  Status s;
  // Per piece the frame lands in: its tensor and the runs of the frame there.
  struct Landing {
    const std::string* key;
    const TensorView* target;
    std::vector<DeviceBackend::Run> runs;
  };
  std::vector<Landing> landings;
  std::vector<DeviceBackend::Run> runs;
  while (it != w.pieces.begin()) {
    --it;
    const auto& [from, op] = *it;
    if (op.file != msg.file || op.file_offset + op.length <= msg.offset) break;
    if (from != msg.from) continue;
    // The frame is a stretch of the piece's shared stream, from the element
    // at its offset on; this rank's own copies out of the piece lie in it.
    const ManifestTensor& t = m.tensors[op.tensor];
    const size_t es = dtype_size(t.dtype);
    const uint64_t first = msg.offset - op.file_offset;
    auto at = packed_position(op, op.shared_box, first, es);
    auto last = at ? unpacked_offset(op, op.shared_box, *at + len - 1, es) : std::nullopt;
    if (!last) continue;
    const uint64_t lo = *at, hi = lo + len;
    // Only the stretch of the piece the frame spans is walked: a piece of
    // many short runs (narrow columns) is not walked whole for every frame.
    ReadOp span = op;
    span.file_offset += first;
    span.chunk_offset += first;
    span.length = *last + 1 - first;
    for_each_copy(span, es, [&](uint64_t src, uint64_t dst, uint64_t n) {
      auto q = packed_position(span, op.shared_box, src, es);
      if (!q) {
        if (s.ok())
          s = Status::internal("rank " + std::to_string(ctx.rank) + ": tensor '" + t.key +
                               "' copies bytes outside the box it receives");
        return;
      }
      const uint64_t a = std::max(*q, lo), b = std::min(*q + n, hi);
      if (a < b) runs.push_back({a - lo, dst + (a - *q), b - a});
    });
    if (!s.ok()) break;
    landings.push_back({&t.key, &w.targets[op.entry], std::move(runs)});
    runs.clear();
  }
  FERRY_RETURN_IF_ERROR(s);
  if (landings.empty())
    return Status::corruption("rank " + std::to_string(ctx.rank) + ": " + what +
                              " match no piece it expects from that rank");
  // A frame that goes whole to one stretch of one tensor (rows) is copied
  // and summed in one pass where the device can, as a block read from disk
  // is: the ring is read once, and the sum is of the very bytes that landed.
  // A mismatch fails the load, which leaves its tensors partly loaded, as
  // any failed load does (the error names the tensor: see unverified).
  const Landing& one = landings.front();
  std::optional<uint64_t> sum;
  if (landings.size() == 1 && one.runs.size() == 1 && one.runs[0].src == 0 &&
      one.runs[0].len == len)
    sum = ctx.device->copy_in_summed(data, *one.target, one.runs[0].dst, len);
  if (sum) {
    if (*sum != msg.checksum) {
      if (w.unverified) w.unverified->add(*one.key);
      return mismatch();
    }
    share_checked();
  } else {
    // Anything else reaches the tensors only after the frame checked out,
    // from the bytes that were checked: a ring's bytes can change at any
    // moment (its sender, or any process of this user, may write them), so
    // they are copied out of it once, summed on the way, and only that copy
    // is used. A frame's own bytes are this process's.
    const uint8_t* from = data;
    uint64_t got = 0;
    if (msg.ring_length != 0) {
      if (w.scratch_bytes < len) {
        w.scratch.reset(new (std::nothrow) uint8_t[len]);
        w.scratch_bytes = w.scratch ? len : 0;
        if (!w.scratch)
          return Status::internal("rank " + std::to_string(ctx.rank) + ": no memory for " + what);
      }
      got = xxh3_64_copy(w.scratch.get(), data, len);
      from = w.scratch.get();
    } else {
      got = xxh3_64(data, len);
    }
    if (got != msg.checksum) return mismatch();
    share_checked();
    CopyLatch latch;
    for (const Landing& l : landings) copy_runs(ctx, *l.key, from, *l.target, l.runs, latch);
    // The frame's bytes are read by the copies: they must land before it goes.
    FERRY_RETURN_IF_ERROR(latch.wait());
  }
  owed->second -= len;
  w.last = std::chrono::steady_clock::now();
  return Status();
}

void end_share(loader_ptr self, const std::string& id, Status s) {
  auto& st = self->state;
  auto it = st.shares.find(id);
  if (it == st.shares.end()) return;
  const uint64_t task = it->second.task;
  // Senders that still owe bytes stop now, rather than wait for acks that
  // will not come.
  if (!s.ok() && it->second.transport)
    for (const auto& [from, n] : it->second.owed)
      if (n > 0) send_ack(*st.ctx, *it->second.transport, id, from, 0, s);
  st.shares.erase(it);
  st.ended.push_back(id);
  if (st.ended.size() > 8) st.ended.pop_front();
  finish_task(*st.ctx, *st.tasks, task, std::move(s));
}

// Why a load owed bytes by `from` fails once `from` failed (`why`).
Status waiting_for(const RankContext& ctx, int32_t from, const Status& why) {
  return why.with_context("rank " + std::to_string(ctx.rank) + " was waiting for bytes rank " +
                          std::to_string(from) + " reads for it: ");
}

// A frame (or a failure) from a reader of another host that sends this rank
// a piece whole: landed, and acknowledged as a node's shared bytes are.
void on_fetched(const RankContext& ctx, Fetches& f, const std::string& load_id,
                const BlockShareMsg& msg) {
  if (!msg.status.ok())
    return f.fail(msg.from, msg.status.with_context("rank " + std::to_string(msg.from) +
                                                    " (another host) failed to read bytes rank " +
                                                    std::to_string(ctx.rank) + " needs from it: "));
  Status s = f.land(msg);
  if (f.transport()) send_ack(ctx, *f.transport(), load_id, msg.from, s.ok() ? msg.length() : 0, s);
  if (!s.ok()) f.fail(msg.from, s);
}

void on_share(loader_ptr self, const BlockShareMsg& msg) {
  auto& st = self->state;
  if (msg.load_id == kAnyLoad)
    for (auto& [id, f] : st.fetches)
      f->fail(msg.from,
              msg.status.with_context("rank " + std::to_string(st.ctx->rank) +
                                      " was waiting for bytes rank " + std::to_string(msg.from) +
                                      " (another host) reads for its node: "));
  if (auto f = st.fetches.find(msg.load_id); f != st.fetches.end() && f->second->sends(msg.from))
    return on_fetched(*st.ctx, *f->second, msg.load_id, msg);
  if (msg.load_id == kAnyLoad) {
    // A rank failed: every load still owed bytes by it fails, naming it.
    std::vector<std::string> owing;
    for (const auto& [id, w] : st.shares)
      if (auto it = w.owed.find(msg.from); it != w.owed.end() && it->second > 0)
        owing.push_back(id);
    for (const auto& id : owing) end_share(self, id, waiting_for(*st.ctx, msg.from, msg.status));
    return;
  }
  auto it = st.shares.find(msg.load_id);
  if (it == st.shares.end()) {
    if (std::find(st.ended.begin(), st.ended.end(), msg.load_id) == st.ended.end())
      st.early[msg.load_id].push_back(msg);
    return;
  }
  ShareWait& w = it->second;
  st.ctx->fs->crash_point("load.receive");
  Status s = take_share(*st.ctx, w, msg);
  if (!s.ok()) return end_share(self, msg.load_id, std::move(s));
  if (w.transport) send_ack(*st.ctx, *w.transport, msg.load_id, msg.from, msg.length(), s);
  for (const auto& [from, n] : w.owed)
    if (n > 0) return;
  end_share(self, msg.load_id, Status());
}

void on_share_due(loader_ptr self, const std::string& id) {
  auto& st = self->state;
  auto it = st.shares.find(id);
  if (it == st.shares.end()) return;
  const auto limit = std::chrono::duration<double>(st.ctx->opts.write_timeout_s);
  const auto idle = std::chrono::steady_clock::now() - it->second.last;
  if (idle < limit) {
    self->delayed_send(loader_actor{self},
                       std::chrono::duration_cast<std::chrono::milliseconds>(limit - idle) +
                           std::chrono::milliseconds(1),
                       atom::share_due_v, id);
    return;
  }
  std::string ranks;
  for (const auto& [from, n] : it->second.owed)
    if (n > 0) ranks += (ranks.empty() ? "" : ", ") + std::to_string(from);
  end_share(self, id,
            Status::timeout("rank " + std::to_string(st.ctx->rank) + ": no bytes from rank(s) " +
                            ranks + ", which read shared bytes for it, within write-timeout (" +
                            std::to_string(st.ctx->opts.write_timeout_s) + " s)"));
}

// Starts waiting for the pieces other ranks read for this one.
void expect_shares(loader_ptr self, LoadJob& job, const std::shared_ptr<LoadInFlight>& load) {
  auto& st = self->state;
  ShareWait w;
  w.manifest = job.manifest;
  w.targets = job.targets;
  w.pieces = std::move(job.receive);
  w.transport = job.transport;
  w.ring = job.ring;
  w.unverified = load->unverified;
  std::sort(w.pieces.begin(), w.pieces.end(), [](const auto& a, const auto& b) {
    return std::tie(a.second.file, a.second.file_offset) <
           std::tie(b.second.file, b.second.file_offset);
  });
  for (size_t i = 0; i < w.pieces.size(); ++i) {
    const auto& [from, op] = w.pieces[i];
    const bool again = i > 0 && w.pieces[i - 1].second.file == op.file &&
                       w.pieces[i - 1].second.file_offset == op.file_offset;
    if (!again)
      w.owed[from] += shared_bytes(op, dtype_size(job.manifest->tensors[op.tensor].dtype));
  }
  w.last = std::chrono::steady_clock::now();
  w.task = st.next_task++;
  st.tasks->emplace(w.task, ReaderTask{kNoReader, load});
  ++load->left;
  st.shares.emplace(job.load_id, std::move(w));
  self->delayed_send(
      loader_actor{self},
      std::chrono::milliseconds(static_cast<int64_t>(st.ctx->opts.write_timeout_s * 1000) + 1),
      atom::share_due_v, job.load_id);
  // A sender that failed before this load began sends nothing more: the
  // link recorded its failure (fail_rank) before telling this loader, whose
  // report (kAnyLoad) ended only the waits that existed then. Without this
  // the wait would last write-timeout.
  for (const auto& [from, n] : st.shares.at(job.load_id).owed)
    if (auto why = n > 0 ? st.ctx->shares->failure(from) : std::nullopt) {
      st.early.clear();
      return end_share(self, job.load_id, waiting_for(*st.ctx, from, *why));
    }
  // Loads run one at a time per rank: what came early for another load is stale.
  auto early = std::move(st.early[job.load_id]);
  st.early.clear();
  for (const auto& msg : early) {
    if (!st.shares.count(job.load_id)) break;  // ended on an earlier frame
    on_share(self, msg);
  }
}

reader_actor spawn_reader(loader_ptr self);

// Starts waiting for the pieces readers of other hosts send this rank whole
// (load-sharing = job), on a reader of their own.
void fetch(loader_ptr self, const LoadJob& job, const std::shared_ptr<LoadInFlight>& load,
           std::vector<ReadOp> ops) {
  auto& st = self->state;
  for (auto it = st.fetches.begin(); it != st.fetches.end();)
    it = it->second->ended() ? st.fetches.erase(it) : std::next(it);
  auto f = std::make_shared<Fetches>(st.ctx->rank, job.transport);
  std::sort(ops.begin(), ops.end(), [](const ReadOp& a, const ReadOp& b) {
    return std::tie(a.file, a.file_offset) < std::tie(b.file, b.file_offset);
  });
  for (const ReadOp& op : ops) {
    f->add(op);
    // A sender that failed before this load began sends nothing (see expect_shares).
    if (auto why = st.ctx->shares->failure(op.fetch_from))
      f->fail(op.fetch_from, waiting_for(*st.ctx, op.fetch_from, *why));
  }
  load->fetches = f;
  st.fetches[job.load_id] = f;
  if (st.readers.size() == st.storage_readers) st.readers.push_back(spawn_reader(self));
  const size_t i = st.storage_readers;
  ReadTask task;
  task.dir = job.dir;
  task.manifest = job.manifest;
  task.targets = job.targets;
  task.load_id = job.load_id;
  task.transport = job.transport;
  task.peer_rings = job.peer_rings;
  task.unverified = load->unverified;
  task.clocks = job.clocks;
  task.fetches = f;
  task.ops = std::move(ops);
  const uint64_t id = st.next_task++;
  st.tasks->emplace(id, ReaderTask{i, load});
  ++load->left;
  self->request(st.readers[i], caf::infinite, atom::read_v, std::move(task))
      .then(
          [self, id](const Status& s) { finish_task(*self->state.ctx, *self->state.tasks, id, s); },
          [self, id, i](caf::error& e) {
            finish_task(
                *self->state.ctx, *self->state.tasks, id,
                Status::internal("reader " + std::to_string(i) + ": " + self->system().render(e)));
          });
  // Frames that came before this load began here (not for a node's share
  // wait, which takes its own in expect_shares).
  if (job.receive.empty()) {
    auto early = std::move(st.early[job.load_id]);
    st.early.clear();
    for (const auto& msg : early) on_share(self, msg);
  }
}

// The host tensors this load fills that were just allocated fault in huge
// pages (advise_huge_pages), before any read or copy touches them. At most
// kAdvisedTargets a load: each flagged range inside a larger mapping (a
// heap) may split it, and the process's count of mappings is bounded.
void advise_fresh_targets(const LoadJob& job) {
  constexpr size_t kAdvisedTargets = 4096;
  std::vector<bool> filled(job.targets.size());
  for (const ReadOp& op : job.ops)
    if (op.entry != ReadOp::kForOthers && op.entry < filled.size()) filled[op.entry] = true;
  for (const auto& [from, op] : job.receive)
    if (op.entry != ReadOp::kForOthers && op.entry < filled.size()) filled[op.entry] = true;
  size_t advised = 0;
  for (size_t i = 0; i < filled.size() && advised < kAdvisedTargets; ++i) {
    const TensorView& t = job.targets[i];
    if (filled[i] && t.device.is_host() && t.is_contiguous() && t.data)
      advised += advise_huge_pages(t.data, t.nbytes()) ? 1 : 0;
  }
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
    for (uint64_t id : lost) finish_task(*st.ctx, *st.tasks, id, why);
    st.readers[i] = spawn_reader(self);
    return true;
  }
  return false;
}

loader_actor::behavior_type loader_fun(loader_ptr self, ContextPtr ctx) {
  self->state.ctx = ctx;
  const uint32_t readers = load_readers(ctx->opts.readers);
  for (uint32_t i = 0; i < readers; ++i) self->state.readers.push_back(spawn_reader(self));
  self->state.storage_readers = readers;
  self->set_exit_handler([self](caf::exit_msg& msg) {
    if (!on_reader_exit(self, msg)) self->quit(msg.reason);  // the runtime shuts down
  });
  self->attach_functor([ctx, tasks = self->state.tasks](const caf::error& reason) {
    const Status why = Status::internal("the loader stopped (" + caf::to_string(reason) + ")");
    // Readers waiting for room in a window end now, not at their timeout.
    ctx->shares->close_all(why);
    while (!tasks->empty()) finish_task(*ctx, *tasks, tasks->begin()->first, why);
  });
  return {
      [self](atom::load, LoadJob& job) -> caf::result<Status> {
        auto& st = self->state;
        // The targets may be memory freed and mapped again since a last load.
        forget_populated();
        advise_fresh_targets(job);
        // Each reader takes a contiguous stretch of the files, equal in bytes:
        // a few long sequential streams, and runs coalesce inside each.
        // Pieces another host sends whole go to a reader of their own, which
        // waits for them while the others read from storage.
        std::vector<ReadOp> fetched;
        std::vector<ReadOp> ops;
        for (ReadOp& op : job.ops) (op.fetch_from >= 0 ? fetched : ops).push_back(std::move(op));
        std::vector<ReadTask> tasks(std::min<size_t>(st.storage_readers, ops.size()));
        if (tasks.empty() && fetched.empty() && job.receive.empty()) return Status();
        std::sort(ops.begin(), ops.end(), [](const ReadOp& a, const ReadOp& b) {
          return std::tie(a.file, a.file_offset) < std::tie(b.file, b.file_offset);
        });
        auto load = std::make_shared<LoadInFlight>();
        load->rp = self->make_response_promise();
        load->load_id = job.load_id;
        load->transport = job.transport;
        uint64_t total = 0;
        for (const auto& op : ops) {
          total += op.length;
          for (const ShareTo& to : op.share_with) load->receivers.push_back(to.rank);
        }
        for (const auto& op : fetched)
          for (const ShareTo& to : op.share_with) load->receivers.push_back(to.rank);
        // As a save's (planner.cpp): a sized-by-use pool takes in what this
        // rank reads, up to its cap.
        if (Status g = total ? st.ctx->pool->grow(total) : Status(); !g.ok())
          std::fprintf(stderr, "ferry: rank %d: the staging pool stays at %llu bytes: %s\n",
                       st.ctx->rank, static_cast<unsigned long long>(st.ctx->pool->bytes()),
                       g.message().c_str());
        std::sort(load->receivers.begin(), load->receivers.end());
        load->receivers.erase(std::unique(load->receivers.begin(), load->receivers.end()),
                              load->receivers.end());
        if (!load->receivers.empty())
          st.ctx->shares->open(st.ctx->rank, job.load_id, load->receivers);
        uint64_t seen = 0;
        for (auto& op : ops) {
          const size_t k =
              total ? std::min<size_t>(tasks.size() - 1, seen * tasks.size() / total) : 0;
          seen += op.length;
          tasks[k].ops.push_back(std::move(op));
        }
        for (const auto& t : tasks) load->left += t.ops.empty() ? 0 : 1;
        for (size_t i = 0; i < tasks.size(); ++i) {
          if (tasks[i].ops.empty()) continue;
          tasks[i].dir = job.dir;
          tasks[i].manifest = job.manifest;
          tasks[i].targets = job.targets;
          tasks[i].load_id = job.load_id;
          tasks[i].transport = job.transport;
          tasks[i].peer_rings = job.peer_rings;
          tasks[i].unverified = load->unverified;
          tasks[i].clocks = job.clocks;
          const uint64_t id = st.next_task++;
          st.tasks->emplace(id, ReaderTask{i, load});
          self->request(st.readers[i], caf::infinite, atom::read_v, std::move(tasks[i]))
              .then(
                  [self, id](const Status& s) {
                    finish_task(*self->state.ctx, *self->state.tasks, id, s);
                  },
                  [self, id, i](caf::error& e) {
                    finish_task(*self->state.ctx, *self->state.tasks, id,
                                Status::internal("reader " + std::to_string(i) + ": " +
                                                 self->system().render(e)));
                  });
        }
        if (!fetched.empty()) fetch(self, job, load, std::move(fetched));
        if (!job.receive.empty()) expect_shares(self, job, load);
        return load->rp;
      },
      [self](atom::share, const BlockShareMsg& msg) { on_share(self, msg); },
      [self](atom::share_due, const std::string& id) { on_share_due(self, id); },
  };
}

}  // namespace

loader_actor spawn_loader(caf::actor_system& sys, ContextPtr ctx) {
  return sys.spawn(loader_fun, std::move(ctx));
}

void set_share_checked_hook(const std::function<void()>* hook) {
  g_share_checked.store(hook, std::memory_order_release);
}

}  // namespace ferry
