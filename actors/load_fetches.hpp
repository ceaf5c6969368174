// Pieces readers of other hosts send this rank whole: the loader lands them, a reader waits.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "actors/context.hpp"
#include "actors/messages.hpp"

namespace ferry {

// The pieces of one load that a reader of another node reads from storage
// and sends whole to this rank (load-sharing = job). The loader lands their
// frames as they come, so a sender's window never waits on this rank's
// readers (which may wait on that sender in turn); the fetching reader waits
// for each piece whole, then checks its blocks against the manifest as if
// it had read them. A piece's memory is taken at its first frame and given
// back once its reader is done with it.
class Fetches {
 public:
  Fetches(int32_t me, std::shared_ptr<Transport> transport)
      : me_(me), transport_(std::move(transport)) {}

  void add(const ReadOp& op);
  bool sends(int32_t rank) const;
  Transport* transport() const { return transport_.get(); }

  // A frame from `msg.from`: copied into its piece once its sum checked out.
  Status land(const BlockShareMsg& msg);

  // Waits until `op`'s piece landed whole: its bytes, valid until release().
  // Fails when its sender failed, or no bytes landed for `idle_s` (a sender
  // reads what it sends from storage first: idle is measured over them all).
  Result<const uint8_t*> wait(const ReadOp& op, double idle_s);
  void release(const ReadOp& op);

  // `rank` failed (`why` names it): the pieces it owes fail.
  void fail(int32_t rank, const Status& why);
  // The load ended here (`why`, or ok when it succeeded): waits end, memory
  // goes, and (on a failure) every sender that still owes bytes is told to
  // stop; later frames are refused.
  void end(const RankContext& ctx, const std::string& load_id, const Status& why);
  bool ended() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Piece {
    int32_t from = -1;
    uint64_t length = 0, got = 0;
    std::unique_ptr<uint8_t[]> buf;
    Status failed;
  };
  const int32_t me_;
  std::shared_ptr<Transport> transport_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<uint32_t, uint64_t>, Piece> pieces_;  // by (file, offset)
  std::set<int32_t> senders_;
  Clock::time_point last_;  // when bytes last landed (or the load began)
  Status ended_;
};

}  // namespace ferry
