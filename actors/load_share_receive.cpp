// Frames of shared bytes checked and landed in a load's tensors (load_share_receive.hpp).

#include "actors/load_share_receive.hpp"

#include <algorithm>
#include <atomic>
#include <functional>
#include <new>
#include <optional>
#include <string>

#include "actors/load_verify.hpp"
#include "actors/loader_actor.hpp"
#include "checksum.hpp"

namespace ferry {

namespace {

std::atomic<const std::function<void()>*> g_share_checked{nullptr};

void share_checked() {
  if (const auto* hook = g_share_checked.load(std::memory_order_acquire)) (*hook)();
}

}  // namespace

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
    landings.push_back({&t.key, &(*w.targets)[op.entry], std::move(runs)});
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

void set_share_checked_hook(const std::function<void()>* hook) {
  g_share_checked.store(hook, std::memory_order_release);
}

}  // namespace ferry
