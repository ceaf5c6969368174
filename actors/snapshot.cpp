// Snapshot: copies the bytes of every file of a save, block by block, from
// the caller's tensors into staging blocks. Copies are asynchronous (a GPU
// copy completes later); filled blocks are forwarded to the serializer in
// file order. One block is issued per message so the mailbox (freed blocks,
// completions, aborts) is served between blocks.
//
//   idle --stream--> filling --(all blocks forwarded)--> idle
//                     |  no free block: waits for `freed`
//                     +--abandon--> idle (blocks it holds go back to the pool)
//
// A copy that was issued cannot be recalled: the blocks of an abandoned save
// whose copies still run become orphans. `abandon` is answered only once no
// copy of that save runs any more, so the planner reports a failed save only
// when the caller may free its tensors.

#include <cstring>
#include <deque>
#include <unordered_map>

#include "actors/messages.hpp"
#include "actors/snapshot_actor.hpp"

namespace ferry {

namespace {

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

  bool all_issued() const { return next_file >= job.files.size(); }
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
      st.ctx->pool->release(b.msg.lease);
    else
      st.orphans.emplace(seq, std::move(b));
    ++seq;
  }
  st.inflight.clear();
}

void finish(snapshot_ptr self, const Status& status) {
  auto& st = self->state;
  self->send(st.planner, atom::snapped_v, st.job.save, status);
  if (!status.ok()) release_all(self);
  st.active = false;
  st.inflight.clear();
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
      st.ctx->pool->release(b.msg.lease);
      finish(self, b.status);
      return;
    }
    self->send(st.serializer, atom::block_v, b.msg);
  }
  if (st.active && st.all_issued() && st.inflight.empty()) finish(self, Status());
}

void issue_block(snapshot_ptr self) {
  auto& st = self->state;
  const FileLayout& f = st.job.files[st.next_file];
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
  struct Copy {
    const ChunkSource* src;
    const std::string* key;
    uint64_t src_off, len, dst_off;
  };
  std::vector<Copy> copies;
  const auto& sources = st.job.sources[st.next_file];
  for (size_t i = 0; i < f.chunks.size(); ++i) {
    const auto& c = f.chunks[i];
    const uint64_t lo = std::max(off, c.offset);
    const uint64_t hi = std::min(off + len, c.offset + c.length);
    if (lo >= hi) continue;
    copies.push_back(
        {&sources[i], &c.chunk.key, sources[i].offset + (lo - c.offset), hi - lo, lo - off});
  }
  b.outstanding = static_cast<uint32_t>(copies.size());
  st.inflight.push_back(std::move(b));

  st.next_offset += len;
  ++st.next_index;
  if (st.next_offset >= f.size) {
    ++st.next_file;
    st.next_offset = 0;
    st.next_index = 0;
  }

  const uint64_t save = st.job.save;
  snapshot_actor me = self;
  for (const Copy& c : copies) {
    // The device names itself and the CUDA error; only we know the tensor.
    st.ctx->device->copy_out(c.src->view, c.src_off, c.len, dst + c.dst_off,
                             [me, save, seq, key = *c.key](Status s) {
                               if (!s.ok()) s = s.with_context("tensor '" + key + "': ");
                               caf::anon_send(me, atom::copied_v, save, seq, std::move(s));
                             });
  }
  // Once the last copy is queued, wait_snapshot(stream) can order the
  // caller's stream after it.
  if (st.all_issued() && st.job.state) st.job.state->mark_copies_issued();
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
        st.seq_base = st.next_seq;  // sequence numbers never repeat (see orphans)
        st.waiting_for_block = false;
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
        issue_block(self);
        if (!st.waiting_for_block) schedule_fill(self);
        flush(self);
      },
      [self](atom::copied, uint64_t save, uint64_t seq, const Status& s) {
        auto& st = self->state;
        if (auto it = st.orphans.find(seq); it != st.orphans.end()) {
          if (--it->second.outstanding == 0) {
            const uint64_t orphan_save = it->second.msg.save;
            st.ctx->pool->release(it->second.msg.lease);
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
          release_all(self);
          st.active = false;
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
