// Direct lanes between the ranks of one node: their calls for callers, rank 0's list of
// them, a rank's install, `ready` and close; frames only, liveness stays with rank 0.

#include "actors/transport_impl.hpp"

#include <ucp/api/ucp.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace ferry {

using transport_detail::format_seconds;
using transport_detail::from_seconds;
using transport_detail::get_le;
using transport_detail::kFrameAmId;
using transport_detail::kLanesAmId;
using transport_detail::kMaxAddressBytes;
using transport_detail::kReadyAmId;
using transport_detail::put_le;

// --- caller-facing ----------------------------------------------------------------

// The ranks whose lane is announced but not up yet, "" when none (mu_ held).
std::string Transport::Impl::pending_lanes_locked() const {
  std::string out;
  for (size_t r = 0; r < lanes_.size(); ++r)
    if (lanes_[r].state == LaneInfo::open && !lanes_[r].up)
      out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

Status Transport::Impl::wait_lanes(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  if (cv_.wait_until(lock, Clock::now() + from_seconds(std::max(0.0, timeout_s)),
                     [&] { return stopped_ || pending_lanes_locked().empty(); }))
    return Status::ok_status();
  return Status::timeout("rank " + std::to_string(opts_.rank) + ": the direct lane(s) to rank(s) " +
                         pending_lanes_locked() + " did not come up within " +
                         format_seconds(timeout_s));
}

int32_t Transport::Impl::next_hop(int32_t to_rank) {
  if (opts_.rank == 0 || to_rank <= 0 || to_rank >= opts_.world_size) return to_rank;
  std::lock_guard<std::mutex> lock(mu_);
  const auto state = lanes_[to_rank].state;
  return state == LaneInfo::open || state == LaneInfo::failed ? to_rank : 0;
}

void Transport::Impl::close_lane(int32_t rank, const Status& why) {
  if (opts_.rank == 0 || rank <= 0 || rank >= opts_.world_size || rank == opts_.rank) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (stopped_ || lanes_[rank].state != LaneInfo::open) return;
  // Closed for callers at once: no frame queued from now on goes to it.
  lanes_[rank].state = LaneInfo::failed;
  lanes_[rank].why = why;
  cv_.notify_all();
  commands_.push_back(Command{Command::close_lane, rank, {}, 0, why});
  ucp_worker_signal(worker_);
}

std::string Transport::Impl::lane_info(int32_t rank) {
  if (rank < 0 || rank >= opts_.world_size) return "";
  std::lock_guard<std::mutex> lock(mu_);
  return lanes_[rank].info;
}

Status Transport::Impl::send_on_lane(int32_t to_rank, std::string frame, uint64_t session) {
  if (to_rank <= 0 || to_rank >= opts_.world_size || to_rank == opts_.rank)
    return Status::invalid_argument("send_on_lane_for_test: no lane to rank " +
                                    std::to_string(to_rank));
  std::lock_guard<std::mutex> lock(mu_);
  if (stopped_ || lanes_[to_rank].state != LaneInfo::open)
    return Status::not_found("send_on_lane_for_test: no open lane to rank " +
                             std::to_string(to_rank));
  commands_.push_back(Command{Command::forged, to_rank, std::move(frame), session, Status()});
  ucp_worker_signal(worker_);
  return Status::ok_status();
}

// --- the progress thread --------------------------------------------------------------

// A `ready` on a lane: the peer knows the session. The first one brings the
// lane up and is answered, since our own first `ready` may have reached the
// peer before it knew the lane (and been dropped there).
void Transport::Impl::lane_ready(Conn* conn) {
  if (conn->phase == Phase::up) return;
  mark_ready(conn);
  send_am(conn, kReadyAmId, std::string());
}

// Rank 0, once every rank joined: each rank learns the ranks of its node,
// their worker addresses and one session per pair. Sent on rank 0's endpoint
// to the rank, after the rank's `ready` (held until then like a frame).
void Transport::Impl::distribute_lanes() {
  if (lanes_done_) return;
  lanes_done_ = true;
  const int32_t n = opts_.world_size;
  std::vector<std::string> body(static_cast<size_t>(n));
  std::vector<uint32_t> count(static_cast<size_t>(n), 0);
  for (int32_t a = 1; a < n; ++a) {
    for (int32_t b = a + 1; b < n; ++b) {
      if (joined_node_[a].empty() || joined_node_[a] != joined_node_[b]) continue;
      uint64_t session = 0;
      while (session == 0 || issued_.count(session) != 0) session = rng_();
      issued_.insert(session);
      for (auto [me, peer] : {std::pair<int32_t, int32_t>{a, b}, {b, a}}) {
        std::string& out = body[me];
        put_le(&out, static_cast<uint64_t>(peer), 4);
        put_le(&out, session, 8);
        put_le(&out, joined_address_[peer].size(), 4);
        out += joined_address_[peer];
        ++count[me];
      }
    }
  }
  for (int32_t r = 1; r < n; ++r) {
    Conn* conn = by_rank_[r];
    if (count[r] == 0 || conn == nullptr || conn->closing) continue;
    std::string msg;
    put_le(&msg, count[r], 4);
    msg += body[r];
    if (conn->phase == Phase::joining) {
      conn->held.push_back(Held{kLanesAmId, std::move(msg), false});
    } else {
      send_am(conn, kLanesAmId, std::move(msg));
    }
  }
}

// A rank > 0: rank 0's list of lanes. Anything malformed leaves this rank
// without lanes (everything goes through rank 0), with one log line.
void Transport::Impl::install_lanes(const std::string& bytes) {
  if (lanes_done_ || stopping_) return;
  lanes_done_ = true;
  struct Entry {
    int32_t rank;
    uint64_t session;
    std::string address;
  };
  std::vector<Entry> entries;
  std::string bad;
  size_t at = 4;
  const uint64_t count = bytes.size() >= 4 ? get_le(bytes.data(), 4) : 0;
  if (bytes.size() < 4 || count >= static_cast<uint64_t>(opts_.world_size)) {
    bad = "bad lane count";
  }
  std::vector<bool> seen(static_cast<size_t>(opts_.world_size), false);
  for (uint64_t i = 0; bad.empty() && i < count; ++i) {
    if (bytes.size() - at < 16) {
      bad = "truncated";
      break;
    }
    Entry e;
    const uint64_t rank = get_le(&bytes[at], 4);
    e.session = get_le(&bytes[at + 4], 8);
    const uint64_t len = get_le(&bytes[at + 12], 4);
    at += 16;
    if (rank == 0 || rank >= static_cast<uint64_t>(opts_.world_size) ||
        static_cast<int32_t>(rank) == opts_.rank || seen[rank]) {
      bad = "rank " + std::to_string(rank) + " out of range or repeated";
    } else if (e.session == 0 || by_session_.count(e.session) != 0) {
      bad = "session in use";
    } else if (len == 0 || len > kMaxAddressBytes || bytes.size() - at < len) {
      bad = "worker address of " + std::to_string(len) + " bytes";
    } else {
      seen[rank] = true;
      e.rank = static_cast<int32_t>(rank);
      e.address = bytes.substr(at, len);
      at += len;
      entries.push_back(std::move(e));
    }
  }
  if (bad.empty() && at != bytes.size()) bad = "trailing bytes";
  if (!bad.empty()) {
    log("ignored rank 0's list of direct lanes (%s): frames to other ranks go through rank 0",
        bad.c_str());
    return;
  }
  for (const Entry& e : entries) {
    Result<Conn*> conn = connect_to(e.rank, e.address, e.session, /*lane=*/true);
    if (!conn.ok()) {
      log("no direct lane to rank %d (frames to it go through rank 0): %s", e.rank,
          conn.status().to_string().c_str());
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      lanes_[e.rank].state = LaneInfo::open;
    }
    send_am(*conn, kReadyAmId, std::string());
  }
}

// Closes the lane to `rank` here (progress thread). Frames held for it are
// dropped, or (`relay_held`, the lane never came up) go to rank 0, which
// passes them on as it does any frame for another rank.
void Transport::Impl::close_lane_now(int32_t rank, const Status& why, bool relay_held) {
  Conn* conn = by_rank_[rank];
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (lanes_[rank].state == LaneInfo::open) {
      lanes_[rank].state = LaneInfo::closed;
      lanes_[rank].why = why;
      cv_.notify_all();
    }
  }
  if (conn == nullptr || !conn->lane || conn->closing) return;
  Conn* hub = by_rank_[0];
  if (relay_held && hub != nullptr && !hub->closing) {
    while (!conn->held.empty()) {
      Held h = std::move(conn->held.front());
      conn->held.pop_front();
      if (h.am_id == kFrameAmId) {
        send_am(hub, kFrameAmId, std::move(h.bytes), h.queued);
      } else if (h.queued) {
        uncount_queued(h.bytes.size());
      }
    }
  }
  drop_conn(conn, /*force=*/true);
}

}  // namespace ferry
