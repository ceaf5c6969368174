#include "share_ring.hpp"

#include "populate.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

namespace ferry {
namespace {

// Frames in flight per window, at least: the sender goes on while the acks
// of the earlier frames travel back.
constexpr uint64_t kFramesPerWindow = 4;
// A large read never becomes one huge frame.
constexpr uint64_t kMaxFrameBytes = 8ull << 20;
// Regions are reserved for every rank of the job, touched only by the ranks
// that send: past this the ring is not offered.
constexpr uint64_t kMaxRingBytes = 1ull << 40;
constexpr unsigned kSeals = F_SEAL_SHRINK | F_SEAL_GROW;

std::string errno_text(int e) {
  return std::strerror(e);
}

// Faults bytes [from, to) of a ring mapped at `base` (`mapped` bytes) in
// with one call instead of a trap per page: a fresh ring has none, and on
// the test VM the faults of a region cost a sender about 20 ms of CPU per
// 2-rank load. Whole pages, inside the mapping.
void fault_in(uint8_t* base, uint64_t mapped, uint64_t from, uint64_t to) {
  constexpr uint64_t kPage = 4096;
  from = from / kPage * kPage;
  to = std::min(mapped / kPage * kPage, (to + kPage - 1) / kPage * kPage);
  if (to > from) (void)populate_pages(base + from, to - from);
}

}  // namespace

uint64_t share_frame_bytes(uint64_t window) {
  return std::min(kMaxFrameBytes, std::max<uint64_t>(1, window / kFramesPerWindow));
}

uint64_t ring_region_bytes(uint64_t window) {
  return window + share_frame_bytes(window);
}

uint64_t ring_region_offset(int32_t rank, uint64_t window) {
  return kRingHeaderBytes + static_cast<uint64_t>(rank) * ring_region_bytes(window);
}

Result<std::unique_ptr<ShareRing>> ShareRing::create(int32_t world, uint64_t window) {
  if (world < 1 || window == 0 ||
      ring_region_bytes(window) > (kMaxRingBytes - kRingHeaderBytes) / static_cast<uint64_t>(world))
    return Status::unsupported("share ring: " + std::to_string(world) + " regions of " +
                               std::to_string(ring_region_bytes(window)) + " bytes are too many");
  const uint64_t bytes = ring_region_offset(world, window);
  const int fd = ::memfd_create("ferry-share-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return Status::unsupported("share ring: memfd_create: " + errno_text(errno));
  auto fail = [fd](const std::string& what) {
    const int e = errno;
    ::close(fd);
    return Status::unsupported("share ring: " + what + ": " + errno_text(e));
  };
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) return fail("ftruncate");
  if (::fcntl(fd, F_ADD_SEALS, kSeals | F_SEAL_SEAL) != 0) return fail("sealing");
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return fail("mmap");
  std::unique_ptr<ShareRing> ring(new ShareRing);
  ring->base_ = static_cast<uint8_t*>(p);
  ring->window_ = window;
  ring->world_ = world;
  ring->populated_.assign(static_cast<size_t>(world), 0);
  std::random_device rd;
  uint64_t token = 0;
  while (token == 0) token = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  std::memcpy(ring->base_, &token, sizeof(token));
  ring->info_ = RingInfo{static_cast<uint32_t>(::getpid()), fd, bytes, token};
  return ring;
}

ShareRing::~ShareRing() {
  if (base_ != nullptr) ::munmap(base_, info_.bytes);
  if (info_.fd >= 0) ::close(info_.fd);
}

const uint8_t* ShareRing::frame(int32_t from, uint64_t offset, uint64_t n) const {
  if (from < 0 || from >= world_ || n == 0) return nullptr;
  const uint64_t lo = ring_region_offset(from, window_);
  const uint64_t size = ring_region_bytes(window_);
  if (offset < lo || offset - lo > size || n > size - (offset - lo)) return nullptr;
  // The sender's pages, not in this mapping yet on the region's first pass.
  uint64_t& populated = populated_[static_cast<size_t>(from)];
  if (offset - lo + n > populated) {
    fault_in(base_, info_.bytes, lo + populated, offset + n);
    populated = offset - lo + n;
  }
  return base_ + offset;
}

Result<std::unique_ptr<PeerRing>> PeerRing::open(const RingInfo& info, int32_t me, int32_t world,
                                                 uint64_t window) {
  const std::string path = "/proc/" + std::to_string(info.pid) + "/fd/" + std::to_string(info.fd);
  // The receiver sized its regions by its own share-window: they may be
  // larger than this sender needs, never smaller.
  uint64_t region_bytes = 0;
  if (info.offered() && world > 0 && info.bytes > kRingHeaderBytes &&
      (info.bytes - kRingHeaderBytes) % static_cast<uint64_t>(world) == 0)
    region_bytes = (info.bytes - kRingHeaderBytes) / static_cast<uint64_t>(world);
  if (me < 0 || me >= world || region_bytes < ring_region_bytes(window))
    return Status::invalid_argument("share ring " + path + " of " + std::to_string(info.bytes) +
                                    " bytes: no region of " +
                                    std::to_string(ring_region_bytes(window)) + " bytes for rank " +
                                    std::to_string(me) + " of " + std::to_string(world));
  const uint64_t region = kRingHeaderBytes + static_cast<uint64_t>(me) * region_bytes;
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return Status::unsupported("share ring " + path + ": " + errno_text(errno));
  struct stat sb {};
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (::fstat(fd, &sb) != 0 || static_cast<uint64_t>(sb.st_size) != info.bytes || seals < 0 ||
      (static_cast<unsigned>(seals) & kSeals) != kSeals) {
    ::close(fd);
    return Status::unsupported("share ring " + path + ": not the sealed ring of " +
                               std::to_string(info.bytes) + " bytes announced");
  }
  void* p = ::mmap(nullptr, info.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int e = errno;
  ::close(fd);  // the mapping keeps the memory
  if (p == MAP_FAILED)
    return Status::unsupported("share ring " + path + ": mmap: " + errno_text(e));
  std::unique_ptr<PeerRing> ring(new PeerRing);
  ring->base_ = static_cast<uint8_t*>(p);
  ring->bytes_ = info.bytes;
  uint64_t token = 0;
  std::memcpy(&token, ring->base_, sizeof(token));
  if (token != info.token)
    return Status::unsupported("share ring " + path +
                               ": not the ring announced (its token differs)");
  ring->region_ = region;
  ring->region_bytes_ = region_bytes;
  return ring;
}

PeerRing::~PeerRing() {
  if (base_ != nullptr) ::munmap(base_, bytes_);
}

uint64_t PeerRing::place(uint64_t n) {
  if (head_ + n > region_bytes_) head_ = 0;
  const uint64_t at = region_ + head_;
  head_ += n;
  // The region's first pass: its pages are not in this mapping yet.
  if (head_ > populated_) {
    fault_in(base_, bytes_, region_ + populated_, region_ + head_);
    populated_ = head_;
  }
  return at;
}

PeerRings::PeerRings(Logger logger, int32_t me, int32_t world, uint64_t window,
                     std::map<int32_t, RingInfo> offered)
    : logger_(std::move(logger)), me_(me), world_(world), window_(window) {
  for (const auto& [rank, info] : offered) peers_[rank].info = info;
}

PeerRings::Lease PeerRings::get(int32_t to) {
  Lease lease;
  auto it = peers_.find(to);
  if (it == peers_.end()) return lease;
  Peer& p = it->second;
  lease.lock = std::unique_lock<std::mutex>(p.mu);
  if (!p.tried) {
    p.tried = true;
    auto r = PeerRing::open(p.info, me_, world_, window_);
    if (r.ok())
      p.ring = std::move(r).value();
    else
      log_printf(logger_, LogLevel::warning,
                 "ferry[rank %d]: sending rank %d its shared bytes over the network: %s", me_, to,
                 r.status().message().c_str());
  }
  lease.ring = p.ring.get();
  if (lease.ring == nullptr) lease.lock.unlock();
  return lease;
}

}  // namespace ferry
