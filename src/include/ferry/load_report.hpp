// What one load restored: a plain value (ferry/runtime.hpp includes this).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ferry {

// What one load restored on this rank (Runtime::load_report).
struct LoadReport {
  std::string path;                       // the checkpoint directory loaded (ROOT/step-...)
  uint64_t step = 0;                      // its step
  uint64_t tensors_restored = 0;          // the state dict's entries: every one was filled
  std::vector<std::string> not_restored;  // checkpoint tensors the state dict did not ask for
  uint64_t bytes_read = 0;                // bytes this rank read from the data files
  uint64_t bytes_received = 0;  // bytes another rank of its node read for it (replicated ones)
  // load-sharing = job: bytes this rank took whole from a rank of another
  // host instead of reading them from storage (not in bytes_read), and the
  // bytes it read and sent whole to ranks of other hosts (once per host).
  uint64_t bytes_fetched = 0;
  uint64_t bytes_sent_to_hosts = 0;
  // The most bytes this rank had queued to send to other ranks at once during
  // the load (replicated bytes it read, and on rank 0 those it passes on
  // between other ranks); share-window bounds it, whatever the state's size.
  uint64_t send_queue_peak = 0;
  // Rank 0: frames of shared bytes (and their acks) it passed on between two
  // other ranks during the load; 0 when the ranks of a node reach each other
  // over direct lanes. 0 on other ranks.
  uint64_t share_frames_relayed = 0;
  // Bytes this rank read for others of its node and put in their share rings
  // (share-memory), not in frames over the network.
  uint64_t shared_in_memory = 0;
  // The node this rank's load counted itself on (boot id and host name): ranks of
  // one node read replicated bytes once between them. Empty in a 1-rank job.
  std::string node;
  // The ranks of its node whose share rings it may put those bytes in
  // (ascending); a rank of another node here would be a bug.
  std::vector<int32_t> share_ring_peers;
};

}  // namespace ferry
