// UCX endpoints and the frames on them: the active-message callbacks, the events they
// record, sends, and an endpoint's creation and close; everything else calls these.

#include "actors/transport_impl.hpp"

#include <unistd.h>

#include <ucp/api/ucp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace ferry {

using transport_detail::format_seconds;
using transport_detail::from_seconds;
using transport_detail::get_le;
using transport_detail::kFrameAmId;
using transport_detail::put_le;
using transport_detail::seconds;
using transport_detail::ucx_error;

namespace {

// stop() waits this long for endpoints to close before destroying the worker.
constexpr auto kCloseGrace = std::chrono::seconds(2);

}  // namespace

// --- UCX callbacks ----------------------------------------------------------------

void Transport::Impl::on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* conn = static_cast<Conn*>(arg);
  conn->owner->events_.push_back(Event{Event::error, conn->id, {}, status});
}

Transport::Impl::Conn* Transport::Impl::conn_for_session(const void* header, size_t header_length) {
  if (header == nullptr || header_length != sizeof(uint64_t)) return nullptr;
  uint64_t session = get_le(static_cast<const char*>(header), sizeof(uint64_t));
  auto it = by_session_.find(session);
  if (it == by_session_.end() || it->second->closing) return nullptr;
  return it->second;
}

ucs_status_t Transport::Impl::on_ready_am(void* arg, const void* header, size_t header_length,
                                          void*, size_t, const ucp_am_recv_param_t*) {
  auto* self = static_cast<Impl*>(arg);
  Conn* conn = self->conn_for_session(header, header_length);
  if (conn == nullptr) {
    // Not counted as foreign: the first `ready` on a lane reaches a peer that
    // has not learnt the lane yet whenever this end learnt it first.
    return UCS_OK;
  }
  self->events_.push_back(Event{Event::ready, conn->id, {}, UCS_OK});
  return UCS_OK;
}

ucs_status_t Transport::Impl::on_lanes_am(void* arg, const void* header, size_t header_length,
                                          void* data, size_t length,
                                          const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  Conn* conn = self->conn_for_session(header, header_length);
  // Only rank 0 hands out lanes, on its own endpoint.
  if (conn == nullptr || conn->lane || conn->rank != 0 || self->opts_.rank == 0) {
    ++self->stray_messages_;
    return UCS_OK;
  }
  return self->receive(conn, Event::lanes, data, length, param);
}

ucs_status_t Transport::Impl::on_frame_am(void* arg, const void* header, size_t header_length,
                                          void* data, size_t length,
                                          const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  // Who it is comes first, how long second: nothing is allocated for a
  // message that is not from a joined peer, or that is over the cap.
  // Returning UCS_OK drops a rendezvous descriptor too.
  Conn* conn = self->conn_for_session(header, header_length);
  if (conn == nullptr) {
    ++self->stray_messages_;
    return UCS_OK;
  }
  return self->receive(conn, Event::frame, data, length, param);
}

ucs_status_t Transport::Impl::receive(Conn* conn, Event::Kind kind, void* data, size_t length,
                                      const ucp_am_recv_param_t* param) {
  if (length > opts_.max_frame_bytes) {
    events_.push_back(Event{Event::oversize, conn->id, {}, UCS_OK, length});
    return UCS_OK;
  }
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    events_.push_back(
        Event{kind, conn->id, std::string(static_cast<const char*>(data), length), UCS_OK});
    return UCS_OK;
  }
  // A large frame: only its announcement is here; fetch the bytes into the
  // string that will be delivered, so they are copied once (a buffer an
  // earlier frame used: FrameBuffers).
  auto* op = new RecvOp{this, conn->id, buffers_->take(length), kind};
  recvs_.insert(op);
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = &Impl::on_recv_done;
  p.user_data = op;
  ucs_status_ptr_t req = ucp_am_recv_data_nbx(worker_, data, op->bytes.data(), length, &p);
  if (req == nullptr) {
    events_.push_back(Event{kind, conn->id, std::move(op->bytes), UCS_OK});
    recvs_.erase(op);
    delete op;
  } else if (UCS_PTR_IS_ERR(req)) {
    log("cannot receive a %zu-byte frame: %s", length, ucs_status_string(UCS_PTR_STATUS(req)));
    recvs_.erase(op);
    delete op;
  }
  return UCS_INPROGRESS;
}

void Transport::Impl::on_send_done(void* request, ucs_status_t, void* user_data) {
  // A failed send needs no action here: the endpoint's error callback reports the peer.
  auto* op = static_cast<SendOp*>(user_data);
  op->owner->end_send(op);
  ucp_request_free(request);
}

void Transport::Impl::end_send(SendOp* op) {
  sends_.erase(op);
  uncount_queued(op->queued);
  buffers_->give(std::move(op->bytes));  // encoded in one (protocol.cpp)
  delete op;
}

void Transport::Impl::on_recv_done(void* request, ucs_status_t status, size_t length,
                                   void* user_data) {
  auto* op = static_cast<RecvOp*>(user_data);
  Impl* self = op->owner;
  if (status == UCS_OK) {
    // Never more than was allocated: UCX copies at most the announced length.
    op->bytes.resize(std::min(length, op->bytes.size()));
    self->events_.push_back(Event{op->kind, op->conn_id, std::move(op->bytes), UCS_OK});
  } else if (!self->stopping_ && status != UCS_ERR_CANCELED) {
    self->log("lost a %zu-byte frame: %s", op->bytes.size(), ucs_status_string(status));
  }
  self->recvs_.erase(op);
  delete op;
  ucp_request_free(request);
}

// --- events and commands --------------------------------------------------------------

void Transport::Impl::dispatch_events() {
  while (!events_.empty()) {
    std::vector<Event> batch;
    batch.swap(events_);
    for (Event& e : batch) {
      Conn* conn = find_conn(e.conn_id);
      if (conn == nullptr || conn->closing) continue;
      switch (e.kind) {
        case Event::frame:
          handle_frame(conn, std::move(e.bytes));
          continue;
        case Event::ready:
          conn->last_rx = Clock::now();
          if (conn->lane) {
            lane_ready(conn);
          } else {
            mark_ready(conn);
          }
          continue;
        case Event::lanes:
          conn->last_rx = Clock::now();
          install_lanes(e.bytes);
          continue;
        case Event::oversize:
          lose_conn(conn, Status::invalid_argument("rank " + std::to_string(conn->rank) +
                                                   " announced a " + std::to_string(e.announced) +
                                                   "-byte frame; the limit is " +
                                                   std::to_string(opts_.max_frame_bytes)));
          continue;
        case Event::error:
          lose_conn(conn, Status::aborted("rank " + std::to_string(conn->rank) +
                                          ": connection lost: " + ucs_status_string(e.status)));
          continue;
      }
    }
  }
}

// Whether a rank failed is rank 0's word: a lane only closes.
void Transport::Impl::lose_conn(Conn* conn, Status why) {
  if (conn->lane) {
    log("closed the direct lane to rank %d: %s", conn->rank, why.message().c_str());
    close_lane_now(conn->rank, why, false);
    return;
  }
  fail_peer(conn->rank, std::move(why));
  drop_conn(conn, /*force=*/true);
}

void Transport::Impl::mark_ready(Conn* conn) {
  if (conn->phase == Phase::up) return;
  conn->phase = Phase::up;
  if (conn->lane) {
    // What UCX chose for this lane, for lane_info() and the logs.
    std::string info;
    char* text = nullptr;
    size_t size = 0;
    if (FILE* f = open_memstream(&text, &size)) {
      ucp_ep_print_info(conn->ep, f);
      std::fclose(f);
      if (text != nullptr) info.assign(text, size);
    }
    std::free(text);
    if (opts_.lane_info) {
      log("direct lane to rank %d is up:\n%s", conn->rank, info.c_str());
    }
    std::lock_guard<std::mutex> lock(mu_);
    lanes_[conn->rank].info = std::move(info);
    lanes_[conn->rank].up = true;
    cv_.notify_all();
  }
  while (!conn->held.empty()) {
    Held h = std::move(conn->held.front());
    conn->held.pop_front();
    send_am(conn, h.am_id, std::move(h.bytes), h.queued);
  }
}

void Transport::Impl::handle_frame(Conn* conn, std::string bytes) {
  conn->last_rx = Clock::now();
  // The peer's own ready message normally comes first; a frame from it
  // proves the same.
  mark_ready(conn);
  if (!stopping_ && cb_.on_frame) cb_.on_frame(conn->rank, std::move(bytes));
}

void Transport::Impl::run_commands() {
  std::deque<Command> batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    batch.swap(commands_);
  }
  for (Command& c : batch) {
    if (c.kind == Command::close_lane) {
      close_lane_now(c.rank, c.why, false);
      continue;
    }
    Conn* conn = by_rank_[c.rank];
    const bool queued = c.kind == Command::send;
    // A peer that failed since send() returned: on_peer_failed says so (or,
    // for a lane, the layer above closed it).
    if (conn == nullptr || conn->closing || (c.kind == Command::forged && !conn->lane)) {
      if (queued) uncount_queued(c.frame.size());
      continue;
    }
    if (c.kind == Command::forged) {
      // Tests: the frame as a stranger who guessed this lane would send it.
      const uint64_t real = conn->session;
      conn->session = c.session;
      send_am(conn, kFrameAmId, std::move(c.frame));
      conn->session = real;
      continue;
    }
    if (conn->phase == Phase::joining) {
      conn->held.push_back(Held{kFrameAmId, std::move(c.frame), true});
    } else {
      send_am(conn, kFrameAmId, std::move(c.frame), true);
    }
  }
}

// --- endpoints ------------------------------------------------------------------------

Result<Transport::Impl::Conn*> Transport::Impl::connect_to(int32_t rank, const std::string& address,
                                                           uint64_t session, bool lane) {
  auto owned = std::make_unique<Conn>();
  Conn* conn = owned.get();
  conn->owner = this;
  conn->id = next_conn_id_++;
  conn->session = session;
  conn->rank = rank;
  conn->lane = lane;
  conn->phase = opts_.rank == 0 || lane ? Phase::joining : Phase::up;
  conn->last_rx = Clock::now();
  conn->due = conn->last_rx + from_seconds(opts_.handshake_timeout_s);
  // Every endpoint of the star has peer error handling: that is how a rank's
  // death is seen. A lane in shm mode has none, so UCX may use shared memory
  // for it (both ends of a lane use one mode: UCX refuses a mismatch).
  conn->peer_mode = !lane || lane_mode_ == LaneMode::tcp;
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
  p.address = reinterpret_cast<const ucp_address_t*>(address.data());
  if (conn->peer_mode) {
    p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = &Impl::on_ep_error;
    p.err_handler.arg = conn;
  }
  ucs_status_t st = ucp_ep_create(worker_, &p, &conn->ep);
  if (st != UCS_OK) {
    return Status::io_error(
        ucx_error(("rank " + std::to_string(opts_.rank) + ": cannot connect to rank " +
                   std::to_string(rank) + " by worker address")
                      .c_str(),
                  st));
  }
  conns_.emplace(conn->id, std::move(owned));
  by_session_[session] = conn;
  by_rank_[rank] = conn;
  return conn;
}

void Transport::Impl::drop_conn(Conn* conn, bool force) {
  if (conn->closing) return;
  conn->closing = true;
  for (const Held& h : conn->held)
    if (h.queued) uncount_queued(h.bytes.size());
  conn->held.clear();
  if (conn->rank >= 0 && by_rank_[conn->rank] == conn) by_rank_[conn->rank] = nullptr;
  auto s = by_session_.find(conn->session);
  if (s != by_session_.end() && s->second == conn) by_session_.erase(s);
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  // Lanes are closed by flush even when forced: UCX 1.13 aborts the process
  // (a debug assertion, dropped upstream later) when a forced close purges a
  // wireup reply still queued to a peer that stopped answering mid-wireup,
  // which a lane to a hung rank can be. The flush ends with the lane's
  // error, and reap_closed releases it then.
  p.flags = force && conn->peer_mode && !conn->lane ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t req = ucp_ep_close_nbx(conn->ep, &p);
  if (req == nullptr || UCS_PTR_IS_ERR(req)) {
    // Closed at once; on error UCX has released the endpoint all the same.
    erase_conn(conn);
  } else if (force && !conn->peer_mode) {
    // A lane without peer error handling cannot be closed by force: its
    // flush waits for a peer that may be dead. Nothing of ours is needed
    // once it is released (no error callback points at the Conn): UCX ends
    // it, at the latest with the worker.
    ucp_request_free(req);
    erase_conn(conn);
  } else {
    conn->close_request = req;
  }
}

void Transport::Impl::reap_closed() {
  for (auto it = conns_.begin(); it != conns_.end();) {
    Conn* conn = it->second.get();
    ++it;
    if (conn->close_request != nullptr &&
        ucp_request_check_status(conn->close_request) != UCS_INPROGRESS) {
      ucp_request_free(conn->close_request);
      erase_conn(conn);
    }
  }
}

void Transport::Impl::erase_conn(Conn* conn) {
  for (const Held& h : conn->held)
    if (h.queued) uncount_queued(h.bytes.size());
  conns_.erase(conn->id);
}

void Transport::Impl::send_am(Conn* conn, unsigned am_id, std::string bytes, bool queued) {
  auto* op = new SendOp{this, 0, std::move(bytes)};
  op->queued = queued ? op->bytes.size() : 0;
  sends_.insert(op);
  // Little endian on the wire whatever this host is.
  std::string header;
  put_le(&header, conn->session, sizeof(uint64_t));
  std::memcpy(&op->session, header.data(), sizeof(uint64_t));
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = &Impl::on_send_done;
  p.user_data = op;
  ucs_status_ptr_t req = ucp_am_send_nbx(conn->ep, am_id, &op->session, sizeof(op->session),
                                         op->bytes.data(), op->bytes.size(), &p);
  if (req == nullptr || UCS_PTR_IS_ERR(req)) end_send(op);
}

void Transport::Impl::shutdown_endpoints() {
  // Frames queued before stop() still go out: the flush below waits for them.
  run_commands();
  stopping_ = true;
  while (!handshakes_.empty()) close_handshake(handshakes_.begin()->first);
  if (listen_fd_ >= 0) {
    close(listen_fd_);
    listen_fd_ = -1;
  }
  std::vector<Conn*> open;
  for (auto& [id, conn] : conns_) {
    if (!conn->closing) open.push_back(conn.get());
  }
  for (Conn* conn : open) drop_conn(conn, /*force=*/conn->phase != Phase::up);
  auto deadline = Clock::now() + kCloseGrace;
  while (!conns_.empty() && Clock::now() < deadline) {
    if (ucp_worker_progress(worker_) == 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    events_.clear();
    reap_closed();
  }
  if (!conns_.empty()) {
    log("%zu endpoint(s) still closing after %s; destroying the worker anyway", conns_.size(),
        format_seconds(seconds(kCloseGrace)).c_str());
    // UCX asserts that a close still in progress when the worker goes was
    // released by its owner.
    for (auto& [id, conn] : conns_) {
      if (conn->close_request != nullptr) ucp_request_free(conn->close_request);
      conn->close_request = nullptr;
    }
  }
}

Transport::Impl::Conn* Transport::Impl::find_conn(uint64_t id) {
  auto it = conns_.find(id);
  return it == conns_.end() ? nullptr : it->second.get();
}

}  // namespace ferry
