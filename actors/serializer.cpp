// Serializer: computes one xxh3-64 per checksum block of every chunk as the
// filled blocks stream past (in file order, so one running hash per file is
// enough), pads the last block of a file for O_DIRECT, and hands each block
// to a writer. When the last block has gone by, the checksums go to the
// planner for its write result.
//
//   idle --stream--> active --(last block handed on, or hashed)--> idle
//                    +--abandon (answered)--> idle: later blocks of the save
//                                           go back to the pool, not on

#include "actors/messages.hpp"
#include "actors/serializer_actor.hpp"
#include "checksum.hpp"

#include <cstring>
#include <map>

namespace ferry {

namespace {

struct FileCursor {
  size_t chunk = 0;       // first chunk not yet fully hashed
  uint64_t in_chunk = 0;  // bytes of that chunk hashed so far
  std::unique_ptr<StreamingChecksum> hash = std::make_unique<StreamingChecksum>();
};

struct serializer_state {
  static inline const char* name = "ferry.serializer";
  ContextPtr ctx;
  std::vector<writer_actor> writers;
  planner_actor planner;

  bool active = false;
  StreamJob job;
  // Blocks filled before a writer has created the files, in file order.
  bool files_open = false;
  std::vector<BlockMsg> before_open;
  std::vector<FileCursor> cursors;
  ChecksumSet sums;
  uint64_t blocks_left = 0;
  // When the whole save fits in the pool, hashing waits until the snapshot
  // is over: the snapshot then copies on a core of its own (the caller waits
  // for the snapshot, not for the checksums). Then every block of the save
  // is here or with a writer, and is hashed in file order while the writers
  // write it (both only read it); it goes back to the pool once written and
  // hashed. The checksums are then ready long before the last write ends.
  bool defer = false;
  uint64_t blocks_hashed = 0;
  std::pair<uint32_t, uint64_t> next_hash{0, 0};  // (file, index) hashed next
  struct Held {
    BlockMsg msg;
    bool written = false;
  };
  std::map<std::pair<uint32_t, uint64_t>, Held> held;  // by (file, index)
  bool hash_queued = false;
};

using serializer_ptr = serializer_actor::stateful_pointer<serializer_state>;

void hash_block(serializer_state& st, const BlockMsg& b, const uint8_t* data) {
  const FileLayout& f = (*st.job.files)[b.file];
  FileCursor& cur = st.cursors[b.file];
  auto& out = st.sums.sums[b.file];
  const uint64_t cb = st.job.checksum_block_bytes;
  const uint64_t end = b.offset + b.len;
  while (cur.chunk < f.chunks.size()) {
    const LaidOutChunk& c = f.chunks[cur.chunk];
    const uint64_t pos = c.offset + cur.in_chunk;
    if (cur.in_chunk < c.length && pos >= end) break;  // the rest is in later blocks
    const uint64_t avail = std::min(end, c.offset + c.length) - std::max(pos, b.offset);
    const uint8_t* p = data + (pos - b.offset);
    uint64_t left = cur.in_chunk < c.length ? avail : 0;
    while (left > 0) {
      const uint64_t take = std::min(left, cb - cur.in_chunk % cb);
      cur.hash->update(p, take);
      p += take;
      left -= take;
      cur.in_chunk += take;
      if (cur.in_chunk % cb == 0 || cur.in_chunk == c.length) {
        out[cur.chunk].push_back(cur.hash->digest());
        cur.hash->reset();
      }
    }
    if (cur.in_chunk < c.length) break;
    ++cur.chunk;
    cur.in_chunk = 0;
  }
}

uint64_t blocks_of(const serializer_state& st, uint32_t file) {
  return ((*st.job.files)[file].size + st.job.block_bytes - 1) / st.job.block_bytes;
}

// Deferred hashing, once the snapshot is over: one block per message, so
// the mailbox (written blocks, an abandon) is served between them; ends the
// job after the last one.
void hash_next(serializer_ptr self) {
  auto& st = self->state;
  if (!st.active || !st.defer || st.blocks_left > 0) return;
  auto it = st.held.find(st.next_hash);
  if (it != st.held.end()) {
    auto data = st.ctx->pool->data(it->second.msg.lease);
    if (data.ok()) hash_block(st, it->second.msg, *data);
    if (it->second.written) {
      (void)st.ctx->pool->release(it->second.msg.lease);
      st.held.erase(it);
    }
    ++st.blocks_hashed;
    if (++st.next_hash.second == blocks_of(st, st.next_hash.first))
      st.next_hash = {st.next_hash.first + 1, 0};
  }
  uint64_t total = 0;
  for (uint32_t f = 0; f < st.job.files->size(); ++f) total += blocks_of(st, f);
  if (st.blocks_hashed == total) {
    self->send(st.planner, atom::sums_v, st.sums);
    st.active = false;
    // The blocks left are still being written: each goes back to the pool
    // as it comes back (the save is no longer active then).
    st.held.clear();
    return;
  }
  if (!st.hash_queued) {
    st.hash_queued = true;
    self->send(serializer_actor{self}, atom::fill_v, st.job.save);
  }
}

// Hashes (unless deferred), pads and hands on one filled block.
void take_block(serializer_ptr self, const BlockMsg& b) {
  auto& st = self->state;
  uint8_t* data = *st.ctx->pool->data(b.lease);
  if (st.job.checksum_block_bytes > 0 && !st.defer) hash_block(st, b, data);
  const auto& file = st.job.handles[b.file];
  uint64_t write_len = b.len;
  if (file->direct()) {
    write_len = direct_io_bytes(b.len);
    std::memset(data + b.len, 0, write_len - b.len);
  }
  // Spread blocks over the writers; each file's blocks go round-robin
  // so one large file is written by all of them.
  const auto& w = st.writers[b.index % st.writers.size()];
  block_return_actor back;
  if (st.defer) {
    back = self;
    st.held.emplace(std::make_pair(b.file, b.index), serializer_state::Held{b});
  }
  self->send(w, atom::write_v, WriteBlock{b, file, write_len, back});
  if (--st.blocks_left == 0 && !st.defer) {
    self->send(st.planner, atom::sums_v, st.sums);
    st.active = false;
  }
  hash_next(self);
}

serializer_actor::behavior_type serializer_fun(serializer_ptr self, ContextPtr ctx,
                                               std::vector<writer_actor> writers,
                                               planner_actor planner) {
  self->state.ctx = std::move(ctx);
  self->state.writers = std::move(writers);
  self->state.planner = std::move(planner);
  return {
      [self](atom::stream, const StreamJob& job) {
        auto& st = self->state;
        st.active = true;
        st.job = job;
        st.cursors.clear();
        st.cursors.resize(job.files->size());
        st.sums = ChecksumSet{job.save, {}};
        st.blocks_left = 0;
        for (const auto& f : *job.files) {
          st.sums.sums.emplace_back(f.chunks.size());
          st.blocks_left += (f.size + job.block_bytes - 1) / job.block_bytes;
        }
        st.held.clear();
        st.blocks_hashed = 0;
        st.next_hash = {0, 0};
        st.hash_queued = false;
        st.files_open = false;
        for (const BlockMsg& b : st.before_open) (void)st.ctx->pool->release(b.lease);
        st.before_open.clear();
        st.defer = job.checksum_block_bytes > 0 && st.blocks_left <= st.ctx->pool->blocks();
        if (st.blocks_left == 0) self->send(st.planner, atom::sums_v, st.sums);
      },
      [self](atom::block, const BlockMsg& b) {
        auto& st = self->state;
        if (!st.active || b.save != st.job.save || !st.ctx->pool->data(b.lease).ok()) {
          (void)st.ctx->pool->release(b.lease);  // a block of an abandoned save
          return;
        }
        if (!st.files_open) return st.before_open.push_back(b);
        take_block(self, b);
      },
      [self](atom::open, uint64_t save, const FileSet& files) {
        auto& st = self->state;
        if (!st.active || save != st.job.save || st.files_open) return;
        st.job.handles = files.files;
        st.files_open = true;
        std::vector<BlockMsg> queued;
        queued.swap(st.before_open);
        for (const BlockMsg& b : queued) take_block(self, b);
      },
      [self](atom::back, const BlockMsg& b) {
        auto& st = self->state;
        auto it = st.held.find({b.file, b.index});
        if (!st.active || !st.defer || b.save != st.job.save || it == st.held.end()) {
          (void)st.ctx->pool->release(b.lease);
          return;
        }
        // Hashed already (everything before next_hash is): done with it.
        if (std::make_pair(b.file, b.index) < st.next_hash) {
          (void)st.ctx->pool->release(b.lease);
          st.held.erase(it);
        } else {
          it->second.written = true;
        }
      },
      [self](atom::fill, uint64_t save) {
        auto& st = self->state;
        st.hash_queued = false;
        if (save == st.job.save) hash_next(self);
      },
      // Answered once no block of `save` will go to a writer any more:
      // everything sent before is already in the writers' mailboxes.
      [self](atom::abandon, uint64_t save) {
        auto& st = self->state;
        if (!st.active || st.job.save != save) return true;
        st.active = false;
        for (const BlockMsg& b : st.before_open) (void)st.ctx->pool->release(b.lease);
        st.before_open.clear();
        // Those not written yet go back to the pool as they come back.
        for (const auto& [key, blk] : st.held)
          if (blk.written) (void)st.ctx->pool->release(blk.msg.lease);
        st.held.clear();
        return true;
      },
      [self](atom::writers, const std::vector<writer_actor>& writers) {
        self->state.writers = writers;
      },
  };
}

}  // namespace

serializer_actor spawn_serializer(caf::local_actor* parent, ContextPtr ctx,
                                  std::vector<writer_actor> writers, planner_actor planner) {
  return parent->spawn<caf::linked>(serializer_fun, std::move(ctx), std::move(writers),
                                    std::move(planner));
}

}  // namespace ferry
