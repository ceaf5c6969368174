// Snapshot: copies the bytes of every file of a save, block by block, from
// the caller's tensors into staging blocks. Copies are asynchronous (a GPU
// copy completes later); filled blocks are forwarded to the serializer in
// file order. A few blocks are issued per message (issuing only queues their
// copies) so the mailbox (freed blocks, completions, aborts) is served often.
//
//   idle --stream--> filling --(all blocks forwarded)--> idle
//                     |  no free block: waits for `freed`
//                     +--abandon--> idle (blocks it holds go back to the pool)
//
// Where copies run. The actor never copies: host tensors' copies go to the
// host copy lanes (copy-threads of them, blocks dealt in turn), threads of
// the snapshot's own with a FIFO queue each, so a snapshot neither waits for
// a busy scheduler nor holds one of its threads, and one core's memory
// bandwidth does not bound it (the writes it feeds can go faster);
// the copies of tensors on cuda:N go to the GPU snapshot actor of device N
// (spawned when a save first uses it), which hands them to that device's
// copy stream in the backend (its per-device bound on copies in flight
// holds). A block's copies on one device post one `copied`; this actor stays
// the state machine (lease order, file order, abandon).
//
// verify-snapshot (always in debug builds): each host chunk's source bytes are
// hashed when the save starts and again when its snapshot ends; a tensor
// that changed in between (the caller broke the snapshot contract) fails
// the save naming it, instead of committing a torn checkpoint. It alone leases pool
// blocks and forwards them, both in file order: the serializer's running
// checksums need each file's blocks in order, and leasing in that order
// means the oldest unforwarded block always holds a lease, so streaming a
// mixed save through a small pool cannot deadlock. The lane is joined when
// the actor exits; tasks still queued then are dropped uncopied.
//
// A copy that was issued cannot be recalled: the blocks of an abandoned save
// whose copies still run become orphans. `abandon` is answered only once no
// copy of that save runs any more, so the planner reports a failed save only
// when the caller may free its tensors. Queued lane tasks of an abandoned
// save are skipped (answered as aborted) rather than run; so are the GPU
// copies of an abandoned save that reach their GPU actor after the abandon.

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "actors/messages.hpp"
#include "actors/snapshot_actor.hpp"
#include "block_walk.hpp"
#include "checksum.hpp"
#include "work_queue.hpp"

namespace ferry {

namespace {

Status abandoned() {
  return Status::aborted("the save was abandoned before this copy started");
}

void copy_out(DeviceBackend& device, const BlockCopy& c, const std::shared_ptr<BlockCopies>& done) {
  // The device names itself and the CUDA error; only we know the tensor.
  device.copy_out(*c.view, c.src_off, c.len, c.dst, [done, key = c.key](Status s) {
    if (!s.ok()) s = s.with_context("tensor '" + *key + "': ");
    done->done(std::move(s));
  });
}

// One per GPU in use: hands that GPU's copies to the backend, which queues
// them on the device's copy stream (never a blocking call here) and reports
// each block's landing to the snapshot through BlockCopies.
struct gpu_snapshot_state {
  static inline const char* name = "ferry.snapshot.gpu";
  ContextPtr ctx;
};

gpu_snapshot_actor::behavior_type gpu_snapshot_fun(
    gpu_snapshot_actor::stateful_pointer<gpu_snapshot_state> self, ContextPtr ctx) {
  self->state.ctx = std::move(ctx);
  return {
      [self](atom::gpu_copy, const GpuCopies& g) {
        if (g.cancelled->load()) {
          for (size_t i = 0; i < g.copies.size(); ++i) g.done->done(abandoned());
          return;
        }
        for (const BlockCopy& c : g.copies) copy_out(*self->state.ctx->device, c, g.done);
      },
      [](atom::gpu_issued, const IssuedMark& mark) { mark.arrive(); },
  };
}

constexpr int kBlocksPerFill = 16;

// The copies into a block at `base` of `len` bytes, cut into `parts` runs,
// each of one stretch of the block. The cuts fall at multiples of 64 KiB of
// the block, as the block's own edges do at multiples of its size: on whole
// elements, and aligned for the streaming stores.
std::vector<std::vector<BlockCopy>> split_copies(std::vector<BlockCopy> copies, const uint8_t* base,
                                                 uint64_t len, size_t parts) {
  constexpr uint64_t kGrain = 64 * 1024;
  const uint64_t share = std::max<uint64_t>(kGrain, (len / parts + kGrain - 1) / kGrain * kGrain);
  std::vector<std::vector<BlockCopy>> out((len + share - 1) / share);
  for (BlockCopy& c : copies) {
    while (c.len > 0) {
      const uint64_t at = static_cast<uint64_t>(c.dst - base);
      BlockCopy piece = c;
      piece.len = std::min(c.len, (at / share + 1) * share - at);
      c.src_off += piece.len;
      c.dst += piece.len;
      c.len -= piece.len;
      out[at / share].push_back(std::move(piece));
    }
  }
  out.erase(std::remove_if(out.begin(), out.end(), [](const auto& r) { return r.empty(); }),
            out.end());
  return out;
}

// A host chunk's source bytes and their xxh3 when the save started.
struct SourceSum {
  std::string key;
  const uint8_t* data = nullptr;
  uint64_t len = 0;
  uint64_t sum = 0;
};

// verify-snapshot: the sums of every contiguous host source of `job` (device
// tensors would need a copy of their own to hash).
std::vector<SourceSum> source_sums(const StreamJob& job) {
  std::vector<SourceSum> out;
  for (size_t f = 0; f < job.files->size() && f < job.sources->size(); ++f) {
    const auto& chunks = (*job.files)[f].chunks;
    for (size_t i = 0; i < chunks.size() && i < (*job.sources)[f].size(); ++i) {
      const ChunkSource& src = (*job.sources)[f][i];
      if (!src.view.device.is_host() || !src.view.data || !src.view.is_contiguous()) continue;
      SourceSum s;
      s.key = chunks[i].chunk.key;
      s.data = static_cast<const uint8_t*>(src.view.data) + src.offset;
      s.len = chunks[i].length;
      s.sum = xxh3_64(s.data, s.len);
      out.push_back(std::move(s));
    }
  }
  return out;
}

// The first source whose bytes changed since source_sums, as the save's error.
Status check_sources(const std::vector<SourceSum>& sums) {
  for (const SourceSum& s : sums)
    if (xxh3_64(s.data, s.len) != s.sum)
      return Status::aborted("tensor '" + s.key +
                             "' changed while the snapshot copied it (its bytes differ before "
                             "and after the copy): a saved tensor must not change until "
                             "wait_snapshot() returns (verify-snapshot)");
  return Status();
}

#ifdef NDEBUG
constexpr bool kAlwaysVerify = false;
#else
constexpr bool kAlwaysVerify = true;  // debug builds check the snapshot contract
#endif

struct InFlight {
  BlockMsg msg;
  uint32_t outstanding = 0;
  Status status;
};

struct snapshot_state {
  static inline const char* name = "ferry.snapshot";
  ContextPtr ctx;
  serializer_actor serializer;
  planner_actor planner;

  bool active = false;
  StreamJob job;
  uint32_t next_file = 0;
  uint64_t next_offset = 0;  // in next_file
  uint64_t next_index = 0;   // block index in next_file
  uint64_t seq_base = 0;     // sequence number of inflight.front()
  uint64_t next_seq = 0;
  std::deque<InFlight> inflight;
  // Blocks of an abandoned job whose copies are still running: their leases
  // go back to the pool when the last copy completes. By sequence number.
  std::unordered_map<uint64_t, InFlight> orphans;
  // Aborts waiting for the orphans of their save, by save.
  std::unordered_map<uint64_t, std::vector<caf::response_promise>> quiet_waiters;
  bool waiting_for_block = false;
  bool fill_pending = false;
  // Set when the current save is abandoned or fails: its queued lane tasks
  // are skipped. A fresh flag per save.
  std::shared_ptr<std::atomic<bool>> cancelled;
  std::optional<BlockWalk> walk;           // over next_file's chunks
  std::vector<ChunkSlice> slices;          // the block being issued's (kept for its capacity)
  std::vector<SourceSum> sums;             // verify-snapshot: the current save's
  std::vector<int> job_devices;            // the current save's: -1 host, N cuda:N
  std::map<int, gpu_snapshot_actor> gpus;  // by CUDA device index
  // Last: destroyed (joined) first, while the pool the copies write to and
  // the device they use are still held above. Blocks go to them in turn.
  std::vector<std::unique_ptr<WorkQueue>> host_lanes;
  size_t next_lane = 0;

  bool all_issued() const { return !job.files || next_file >= job.files->size(); }
};

using snapshot_ptr = snapshot_actor::stateful_pointer<snapshot_state>;

bool copies_running(const snapshot_state& st, uint64_t save) {
  for (const auto& [seq, b] : st.orphans)
    if (b.msg.save == save) return true;
  return st.active && st.job.save == save && !st.inflight.empty();
}

void answer_quiet(snapshot_ptr self, uint64_t save) {
  auto& st = self->state;
  auto it = st.quiet_waiters.find(save);
  if (it == st.quiet_waiters.end() || copies_running(st, save)) return;
  for (auto& rp : it->second) rp.deliver(true);
  st.quiet_waiters.erase(it);
}

void release_all(snapshot_ptr self) {
  auto& st = self->state;
  uint64_t seq = st.seq_base;
  for (auto& b : st.inflight) {
    if (b.outstanding == 0)
      (void)st.ctx->pool->release(b.msg.lease);
    else
      st.orphans.emplace(seq, std::move(b));
    ++seq;
  }
  st.inflight.clear();
}

void cancel_queued(snapshot_state& st) {
  if (st.cancelled) st.cancelled->store(true);
}

void finish(snapshot_ptr self, Status status) {
  auto& st = self->state;
  if (status.ok()) status = check_sources(st.sums);
  st.sums.clear();
  self->send(st.planner, atom::snapped_v, st.job.save, status);
  if (!status.ok()) {
    cancel_queued(st);
    release_all(self);
  }
  st.active = false;
  st.inflight.clear();
  st.walk.reset();
  st.job = StreamJob{};
}

void schedule_fill(snapshot_ptr self) {
  auto& st = self->state;
  if (st.fill_pending || !st.active || st.all_issued()) return;
  st.fill_pending = true;
  self->send(snapshot_actor{self}, atom::fill_v, st.job.save);
}

// Forwards completed blocks in order; ends the snapshot after the last one.
void flush(snapshot_ptr self) {
  auto& st = self->state;
  while (!st.inflight.empty() && st.inflight.front().outstanding == 0) {
    InFlight b = std::move(st.inflight.front());
    st.inflight.pop_front();
    ++st.seq_base;
    if (!b.status.ok()) {
      (void)st.ctx->pool->release(b.msg.lease);
      finish(self, b.status);
      return;
    }
    self->send(st.serializer, atom::block_v, b.msg);
  }
  if (st.active && st.all_issued() && st.inflight.empty()) finish(self, Status());
}

void issue_block(snapshot_ptr self) {
  auto& st = self->state;
  const FileLayout& f = (*st.job.files)[st.next_file];
  auto lease = st.ctx->pool->try_acquire();
  if (!lease) {
    st.waiting_for_block = true;
    return;
  }
  uint8_t* dst = *st.ctx->pool->data(*lease);
  const uint64_t off = st.next_offset;
  const uint64_t len = std::min<uint64_t>(st.job.block_bytes, f.size - off);
  InFlight b;
  b.msg = BlockMsg{st.job.save, st.next_file, st.next_index, *lease, off, len};
  const uint64_t seq = st.next_seq++;

  // The header is ours, not the caller's: copy it directly.
  if (off < f.header.size()) {
    const uint64_t n = std::min<uint64_t>(len, f.header.size() - off);
    std::memcpy(dst, f.header.data() + off, n);
  }
  if (!st.walk) st.walk.emplace(f);
  st.slices.clear();
  st.walk->next(off, len, st.slices);
  const auto& sources = (*st.job.sources)[st.next_file];
  st.inflight.push_back(std::move(b));
  // The first writes wait for the save's first block alone: its copies are
  // shared by every lane. Later blocks are dealt whole, one per lane.
  const bool first_block = st.next_file == 0 && off == 0;

  st.next_offset += len;
  ++st.next_index;
  if (st.next_offset >= f.size) {
    ++st.next_file;
    st.next_offset = 0;
    st.next_index = 0;
    st.walk.reset();
  }

  const uint64_t save = st.job.save;
  std::map<int, std::vector<BlockCopy>> by_device;  // -1: host
  for (const ChunkSlice& c : st.slices) {
    const ChunkSource& src = sources[c.chunk];
    const Device& d = src.view.device;
    by_device[d.is_host() ? -1 : d.index].push_back({&src.view, src.offset + c.chunk_off, c.len,
                                                     dst + c.block_off,
                                                     &f.chunks[c.chunk].chunk.key});
  }
  st.inflight.back().outstanding = static_cast<uint32_t>(by_device.size());
  for (auto& [device, block_copies] : by_device) {
    if (std::find(st.job_devices.begin(), st.job_devices.end(), device) == st.job_devices.end())
      st.job_devices.push_back(device);
    if (device >= 0) {
      auto done = std::make_shared<BlockCopies>(self, save, seq, block_copies.size(),
                                                st.job.sources, st.job.files);
      auto& gpu = st.gpus[device];
      if (!gpu) gpu = self->spawn<caf::linked>(gpu_snapshot_fun, st.ctx);
      self->send(gpu, atom::gpu_copy_v, GpuCopies{std::move(block_copies), done, st.cancelled});
      continue;
    }
    if (st.host_lanes.empty())
      for (uint32_t i = 0; i < st.ctx->opts.copy_threads; ++i)
        st.host_lanes.push_back(
            std::make_unique<WorkQueue>("ferry.copy", 1, WorkQueue::AtStop::drop_queued));
    std::vector<std::vector<BlockCopy>> runs;
    if (first_block && st.host_lanes.size() > 1)
      runs = split_copies(std::move(block_copies), dst, len, st.host_lanes.size());
    else
      runs.push_back(std::move(block_copies));
    size_t pieces = 0;
    for (const auto& run : runs) pieces += run.size();
    auto done =
        std::make_shared<BlockCopies>(self, save, seq, pieces, st.job.sources, st.job.files);
    for (auto& run : runs) {
      WorkQueue& lane = *st.host_lanes[st.next_lane++ % st.host_lanes.size()];
      lane.post([device = st.ctx->device, cancelled = st.cancelled, done, run = std::move(run),
                 me = caf::actor_cast<caf::actor>(self)] {
        if (cancelled->load()) {
          for (size_t i = 0; i < run.size(); ++i) done->done(abandoned());
          return;
        }
        try {
          for (const BlockCopy& c : run) copy_out(*device, c, done);
        } catch (...) {
          // A backend that throws is a bug: end the snapshot actor as if it
          // had thrown there, so the planner linked to it fails every wait.
          caf::anon_send_exit(me, caf::exit_reason::unhandled_exception);
        }
      });
    }
  }
  // Once the last copy is queued with its device, wait_snapshot(stream) can
  // order the caller's stream after it: the host lanes and each GPU actor say
  // so after they handed on what came before (both are FIFO).
  if (!st.all_issued() || !st.job.state) return;
  if (st.job_devices.empty()) return st.job.state->mark_copies_issued();
  // Every host lane says so, not only the one with the last block: the
  // others may still copy earlier ones.
  size_t marks = 0;
  for (int device : st.job_devices) marks += device >= 0 ? 1 : st.host_lanes.size();
  IssuedMark mark{std::make_shared<std::atomic<size_t>>(marks), st.job.state};
  for (int device : st.job_devices) {
    if (device >= 0)
      self->send(st.gpus[device], atom::gpu_issued_v, mark);
    else
      for (auto& lane : st.host_lanes) lane->post([mark] { mark.arrive(); });
  }
}

snapshot_actor::behavior_type snapshot_fun(snapshot_ptr self, ContextPtr ctx,
                                           serializer_actor serializer, planner_actor planner) {
  self->state.ctx = std::move(ctx);
  self->state.serializer = std::move(serializer);
  self->state.planner = std::move(planner);
  return {
      [self](atom::stream, const StreamJob& job) {
        auto& st = self->state;
        if (st.active)
          finish(self, Status::aborted("superseded by save " + std::to_string(job.save)));
        st.active = true;
        st.job = job;
        st.next_file = 0;
        st.next_offset = 0;
        st.next_index = 0;
        st.walk.reset();
        st.seq_base = st.next_seq;  // sequence numbers never repeat (see orphans)
        st.waiting_for_block = false;
        st.cancelled = std::make_shared<std::atomic<bool>>(false);
        st.job_devices.clear();
        st.sums.clear();
        if (kAlwaysVerify || st.ctx->opts.verify_snapshot) st.sums = source_sums(job);
        if (st.all_issued()) {
          finish(self, Status());
          return;
        }
        schedule_fill(self);
      },
      [self](atom::fill, uint64_t save) {
        auto& st = self->state;
        st.fill_pending = false;
        if (!st.active || save != st.job.save || st.all_issued()) return;
        // Issuing only queues copies, so a few blocks per message keep the
        // lanes' queues ahead of their copies (a lane that runs dry sleeps
        // and has to be woken for the next block).
        for (int i = 0;
             i < kBlocksPerFill && st.active && !st.all_issued() && !st.waiting_for_block; ++i)
          issue_block(self);
        if (!st.waiting_for_block) schedule_fill(self);
        flush(self);
      },
      [self](atom::copied, uint64_t save, uint64_t seq, const Status& s) {
        auto& st = self->state;
        if (auto it = st.orphans.find(seq); it != st.orphans.end()) {
          if (--it->second.outstanding == 0) {
            const uint64_t orphan_save = it->second.msg.save;
            (void)st.ctx->pool->release(it->second.msg.lease);
            st.orphans.erase(it);
            answer_quiet(self, orphan_save);
          }
          return;
        }
        if (!st.active || save != st.job.save || seq < st.seq_base) return;
        InFlight& b = st.inflight[seq - st.seq_base];
        if (!s.ok() && b.status.ok()) b.status = s;
        if (b.outstanding > 0) --b.outstanding;
        flush(self);
      },
      [self](atom::freed) {
        auto& st = self->state;
        if (!st.waiting_for_block) return;
        st.waiting_for_block = false;
        schedule_fill(self);
      },
      // Answered (true) once no copy of `save` runs any more.
      [self](atom::abandon, uint64_t save) -> caf::result<bool> {
        auto& st = self->state;
        if (st.active && save == st.job.save) {
          cancel_queued(st);
          release_all(self);
          st.active = false;
          st.walk.reset();
          st.job = StreamJob{};
        }
        if (!copies_running(st, save)) return true;
        auto rp = self->make_response_promise();
        st.quiet_waiters[save].push_back(rp);
        return rp;
      },
  };
}

}  // namespace

snapshot_actor spawn_snapshot(caf::local_actor* parent, ContextPtr ctx, serializer_actor serializer,
                              planner_actor planner) {
  return parent->spawn<caf::linked>(snapshot_fun, std::move(ctx), std::move(serializer),
                                    std::move(planner));
}

}  // namespace ferry
