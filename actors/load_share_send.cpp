// Frames of a reader's verified bytes for the ranks that share them (load_share_send.hpp).

#include "actors/load_share_send.hpp"

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "checksum.hpp"
#include "copy_bytes.hpp"

namespace ferry {

namespace {

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

}  // namespace

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

}  // namespace ferry
