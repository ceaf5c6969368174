// Shared memory for the bytes one rank reads for another of its node during
// a load (BlockShare). Sent over a lane, those bytes cross TCP loopback: two
// kernel copies and the TCP stack for every byte, which on a 2-vCPU node
// took about a quarter of the CPU of a load split by columns over 2 ranks.
//
// Each receiving rank offers a ring for the load: a sealed memfd (it can
// neither shrink nor grow, so a mapping of it never faults) that its senders
// map through /proc/<pid>/fd/<fd> and write into; a BlockShare then carries
// only where in the ring its bytes lie, and the receiver copies them from
// its own memory. Each sender has a region of its own (by its rank), used
// as a circular buffer in the order its frames go, which is the order they
// are taken and acknowledged. A random token at the start of the ring tells
// a sender that it mapped the ring the receiver announced (not another
// process's file under a reused pid). A sender that cannot map a ring (a
// container without /proc of its peer, a non-dumpable peer) sends frames.
//
// Thread-safety: a ShareRing is written by other processes and read by the
// receiver's loader only; a PeerRing's writer is the caller's to serialize.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "ferry/status.hpp"
#include "log.hpp"

namespace ferry {

// What a receiver announces in its needs report; bytes == 0: no ring.
struct RingInfo {
  uint32_t pid = 0;
  int32_t fd = -1;
  uint64_t bytes = 0;
  uint64_t token = 0;
  bool offered() const { return bytes > 0; }
};

// Bytes before the first region: the token, then nothing (page aligned).
constexpr uint64_t kRingHeaderBytes = 4096;

// The bytes of data a frame carries at most, for a share window.
uint64_t share_frame_bytes(uint64_t window);
// One sender's region: a window of frames in flight, and room for the last
// one to wrap (a frame never straddles the region's end).
uint64_t ring_region_bytes(uint64_t window);
// Where sender `rank`'s region starts in a ring.
uint64_t ring_region_offset(int32_t rank, uint64_t window);

// The receiver's ring, for `world` senders' regions. Unmapped and closed
// when destroyed; senders' mappings keep the memory until they drop them.
class ShareRing {
 public:
  static Result<std::unique_ptr<ShareRing>> create(int32_t world, uint64_t window);
  ~ShareRing();
  ShareRing(const ShareRing&) = delete;
  ShareRing& operator=(const ShareRing&) = delete;

  RingInfo info() const { return info_; }
  uint64_t window() const { return window_; }
  // The bytes a frame from `from` says lie at [offset, offset + n): null
  // unless they lie inside that sender's region.
  const uint8_t* frame(int32_t from, uint64_t offset, uint64_t n) const;

 private:
  ShareRing() = default;
  RingInfo info_;
  uint64_t window_ = 0;
  int32_t world_ = 0;
  uint8_t* base_ = nullptr;
  // Per sender: bytes of its region faulted into this mapping (see frame).
  mutable std::vector<uint64_t> populated_;
};

// A sender's mapping of one receiver's ring: its own region, written as a
// circular buffer. Frames must go in the order they are placed.
class PeerRing {
 public:
  // Fails (the caller sends frames instead) unless the file at
  // /proc/<pid>/fd/<fd> is a sealed memfd of the announced size that starts
  // with the token, with `world` regions each large enough for `window`
  // (this sender's share-window; the receiver's may differ).
  static Result<std::unique_ptr<PeerRing>> open(const RingInfo& info, int32_t me, int32_t world,
                                                uint64_t window);
  ~PeerRing();
  PeerRing(const PeerRing&) = delete;
  PeerRing& operator=(const PeerRing&) = delete;

  // Room for the next frame of `n` bytes (at most share_frame_bytes): its
  // offset in the ring. The caller holds the window for it, which keeps the
  // region's unacknowledged frames clear of it.
  uint64_t place(uint64_t n);
  uint8_t* at(uint64_t offset) { return base_ + offset; }

 private:
  PeerRing() = default;
  uint8_t* base_ = nullptr;
  uint64_t bytes_ = 0;
  uint64_t region_ = 0, region_bytes_ = 0;
  uint64_t head_ = 0;       // next free byte, from the region's start
  uint64_t populated_ = 0;  // bytes from the region's start faulted in
};

// A sender's rings of one load: those the receivers of its node offered,
// each opened the first time it sends to that receiver. Thread-safe.
class PeerRings {
 public:
  // `logger`: where a ring that does not open is said (once).
  PeerRings(Logger logger, int32_t me, int32_t world, uint64_t window,
            std::map<int32_t, RingInfo> offered);

  // The ring of `to`, with its lock held until the frame placed in it went
  // (so frames go in the order they were placed), or no ring: `to` offered
  // none, or it did not open (said once to the logger) and frames go instead.
  struct Lease {
    std::unique_lock<std::mutex> lock;
    PeerRing* ring = nullptr;
  };
  Lease get(int32_t to);

 private:
  struct Peer {
    RingInfo info;
    bool tried = false;
    std::unique_ptr<PeerRing> ring;
    std::mutex mu;
  };
  Logger logger_;
  int32_t me_;
  int32_t world_;
  uint64_t window_;
  std::map<int32_t, Peer> peers_;  // fixed at construction; each Peer has its own lock
};

}  // namespace ferry
