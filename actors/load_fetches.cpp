// Pieces sent whole by readers of other hosts, landed and waited for (load_fetches.hpp).

#include "actors/load_fetches.hpp"

#include <new>

#include "checksum.hpp"

namespace ferry {

void Fetches::add(const ReadOp& op) {
  std::lock_guard<std::mutex> l(mu_);
  Piece& p = pieces_[{op.file, op.file_offset}];
  p.from = op.fetch_from;
  p.length = op.length;
  senders_.insert(op.fetch_from);
  last_ = Clock::now();
}

bool Fetches::sends(int32_t rank) const {
  std::lock_guard<std::mutex> l(mu_);
  return senders_.count(rank) > 0;
}

Status Fetches::land(const BlockShareMsg& msg) {
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

Result<const uint8_t*> Fetches::wait(const ReadOp& op, double idle_s) {
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

void Fetches::release(const ReadOp& op) {
  std::lock_guard<std::mutex> l(mu_);
  if (auto it = pieces_.find({op.file, op.file_offset}); it != pieces_.end())
    it->second.buf.reset();
}

void Fetches::fail(int32_t rank, const Status& why) {
  std::lock_guard<std::mutex> l(mu_);
  for (auto& [at, p] : pieces_)
    if (p.from == rank && p.got < p.length && p.failed.ok()) p.failed = why;
  cv_.notify_all();
}

void Fetches::end(const RankContext& ctx, const std::string& load_id, const Status& why) {
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
    (void)transport_->send(transport_->next_hop(from),
                           encode_message(ShareAckMsg{ctx.job_id, load_id, me_, from, 0, ended_}));
}

bool Fetches::ended() const {
  std::lock_guard<std::mutex> l(mu_);
  return !ended_.ok();
}

}  // namespace ferry
