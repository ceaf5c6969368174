#include "replica_check.hpp"

#include <algorithm>
#include <future>
#include <map>
#include <tuple>

#include "checksum.hpp"

namespace ferry {
namespace {

constexpr uint64_t kWindowBytes = 4096;
constexpr uint64_t kWindows = 64;
// Device or strided bytes are hashed through a buffer of at most this.
constexpr uint64_t kStageBytes = 8ull << 20;

// "0, 2" or "1-3": ascending ranks, runs joined.
std::string rank_list(const std::vector<int32_t>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += std::to_string(ranks[i]);
    if (j > i) out += (j == i + 1 ? ", " : "-") + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out;
}

std::string ranks_phrase(const std::vector<int32_t>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + rank_list(ranks);
}

std::string offsets_text(const std::vector<int64_t>& offsets) {
  std::string s = "[";
  for (size_t i = 0; i < offsets.size(); ++i) s += (i ? ", " : "") + std::to_string(offsets[i]);
  return s + "]";
}

}  // namespace

ReplicaCheck replica_mode(ReplicaCheck configured, uint64_t nbytes) {
  if (configured != ReplicaCheck::automatic) return configured;
  return nbytes <= kReplicaCheckFullBytes ? ReplicaCheck::full : ReplicaCheck::sampled;
}

std::vector<std::pair<uint64_t, uint64_t>> replica_ranges(ReplicaCheck mode, uint64_t nbytes) {
  if (nbytes == 0 || mode == ReplicaCheck::off) return {};
  if (mode != ReplicaCheck::sampled || nbytes <= kWindows * kWindowBytes) return {{0, nbytes}};
  std::vector<std::pair<uint64_t, uint64_t>> out;
  const uint64_t last = nbytes - kWindowBytes;
  for (uint64_t i = 0; i < kWindows; ++i) out.push_back({last / (kWindows - 1) * i, kWindowBytes});
  out.back().first = last;  // the final bytes, whatever the rounding
  return out;
}

Result<uint64_t> replica_digest(DeviceBackend& device, const TensorView& view, ReplicaCheck mode) {
  const uint64_t n = view.nbytes();
  StreamingChecksum sum;
  sum.update(&n, sizeof n);
  const bool in_place = view.device.is_host() && view.is_contiguous();
  std::vector<uint8_t> stage;
  for (auto [off, len] : replica_ranges(mode, n)) {
    if (in_place) {
      sum.update(static_cast<const uint8_t*>(view.data) + off, len);
      continue;
    }
    while (len > 0) {
      const uint64_t piece = std::min(len, kStageBytes);
      stage.resize(std::max<uint64_t>(stage.size(), piece));
      std::promise<Status> copied;
      device.copy_out(view, off, piece, stage.data(),
                      [&copied](Status s) { copied.set_value(std::move(s)); });
      FERRY_RETURN_IF_ERROR(copied.get_future().get());
      sum.update(stage.data(), piece);
      off += piece;
      len -= piece;
    }
  }
  return sum.digest();
}

Status compare_replica_digests(const std::vector<RankDigests>& ranks) {
  // (key, offsets, sampled) -> digest -> holders, all ordered: the error
  // names the first disagreeing key, whichever order the ranks reported in.
  using Item = std::tuple<std::string, std::vector<int64_t>, bool>;
  std::map<Item, std::map<uint64_t, std::vector<int32_t>>> seen;
  for (const RankDigests& r : ranks) {
    if (!r.digests) continue;
    for (const ReplicaDigest& d : *r.digests)
      seen[Item{d.key, d.offsets, d.sampled}][d.digest].push_back(r.rank);
  }
  for (auto& [item, values] : seen) {
    if (values.size() < 2) continue;
    const auto& [key, offsets, sampled] = item;
    // The largest group first: usually one rank is the odd one out.
    std::vector<std::vector<int32_t>> groups;
    for (auto& [digest, holders] : values) {
      std::sort(holders.begin(), holders.end());
      groups.push_back(holders);
    }
    std::stable_sort(groups.begin(), groups.end(),
                     [](const auto& a, const auto& b) { return a.size() > b.size(); });
    std::string who =
        ranks_phrase(groups[0]) + (groups[0].size() == 1 ? " holds" : " hold") + " one value";
    for (size_t g = 1; g < groups.size(); ++g) who += ", " + ranks_phrase(groups[g]) + " another";
    return Status::invalid_argument(
        "tensor '" + key + "' (box at " + offsets_text(offsets) +
        ") is saved by several ranks under the same key and box, so it is written once, but "
        "their values differ: " +
        who + " (replica-check " + (sampled ? "sampled" : "full") +
        "). A value that differs by rank (an RNG state, a data position) must be saved under a "
        "key of its own on each rank");
  }
  return Status();
}

}  // namespace ferry
