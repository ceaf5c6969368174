// Ferry's settings: one table of keys and a strict validator; the INI files
// they come from are read by config_ini.cpp. Every bad value stops the start
// with a message naming key, value and source.
#include "ferry/options.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "config_ini.hpp"
#include "ferry/size.hpp"
#include "text.hpp"
#include "trace.hpp"

namespace ferry {
namespace {

constexpr uint64_t kKiB = 1ull << 10;
constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGiB = 1ull << 30;
constexpr uint64_t kTiB = 1ull << 40;
// O_DIRECT wants offsets and lengths aligned to the logical block size; 4096
// covers every device Ferry targets, so sizes that become write or checksum
// boundaries must be multiples of it.
constexpr uint64_t kAlign = 4096;
constexpr uint64_t kMaxChunkBytes = kGiB;
// chunk-bytes = auto: 32 MiB writes reached 0.95-0.98 of a raw O_DIRECT
// writer where 8 MiB ones reached 0.89-0.93 (ferry_bench_save, 1 GiB), but a
// small pool still wants several blocks in flight: at least this many.
constexpr uint64_t kAutoChunkBytes = 32 * kMiB;
constexpr uint64_t kMinAutoBlocks = 8;
constexpr uint64_t kMinAutoChunkBytes = 64 * kKiB;
constexpr uint64_t kDefaultPoolCap = 1024 * kMiB;  // pool-bytes = auto without a cap
constexpr uint32_t kMaxThreads = 64;

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

bool all_digits(const std::string& s) {
  return !s.empty() &&
         std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c); });
}

// The size syntax itself; the message says why the text is not a size.
Result<uint64_t> size_from_text(const std::string& text) {
  std::string why =
      "expected a size like 512MiB (a whole number of bytes, optionally with a suffix "
      "B, KB/MB/GB/TB, KiB/MiB/GiB/TiB or K/M/G/T)";
  const std::string t = trim(text);
  size_t n = 0;
  while (n < t.size() && std::isdigit(static_cast<unsigned char>(t[n]))) ++n;
  if (n == 0) {
    if (!t.empty() && t[0] == '-') why = "a size cannot be negative";
    return Status::invalid_argument(why);
  }
  uint64_t number = 0;
  auto [p, ec] = std::from_chars(t.data(), t.data() + n, number);
  if (ec != std::errc() || p != t.data() + n) {
    return Status::invalid_argument("too large for a 64-bit byte count");
  }
  const std::string suffix = lower(trim(t.substr(n)));
  static const std::pair<const char*, uint64_t> kSuffixes[] = {
      {"", 1},
      {"b", 1},
      {"k", kKiB},
      {"kib", kKiB},
      {"m", kMiB},
      {"mib", kMiB},
      {"g", kGiB},
      {"gib", kGiB},
      {"t", kTiB},
      {"tib", kTiB},
      {"kb", 1000},
      {"mb", 1000 * 1000},
      {"gb", 1000ull * 1000 * 1000},
      {"tb", 1000ull * 1000 * 1000 * 1000},
  };
  for (const auto& [name, mult] : kSuffixes) {
    if (suffix != name) continue;
    if (number > std::numeric_limits<uint64_t>::max() / mult)
      return Status::invalid_argument("too large for a 64-bit byte count");
    return number * mult;
  }
  return Status::invalid_argument(why);
}

// ---- value parsers: each returns false and leaves `why` set on bad input ----

bool parse_uint(const std::string& text, uint64_t max, uint64_t& out) {
  const std::string t = trim(text);
  if (!all_digits(t)) return false;
  auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), out);
  return ec == std::errc() && p == t.data() + t.size() && out <= max;
}

bool parse_size(const std::string& text, uint64_t& out, std::string& why) {
  auto size = size_from_text(text);
  if (!size.ok()) {
    why = size.status().message();
    return false;
  }
  out = *size;
  return true;
}

bool parse_bool(const std::string& text, bool& out, std::string& why) {
  why = "expected true/false, on/off, yes/no or 1/0";
  const std::string t = lower(trim(text));
  if (t == "true" || t == "on" || t == "yes" || t == "1") {
    out = true;
    return true;
  }
  if (t == "false" || t == "off" || t == "no" || t == "0") {
    out = false;
    return true;
  }
  return false;
}

// Seconds as a plain decimal ("2.5"), or with an "s" or "ms" suffix. No
// exponents, signs, inf or nan: from_chars would take them, users don't mean them.
bool parse_duration(const std::string& text, double& out, std::string& why) {
  why = "expected a duration like 30, 2.5s or 500ms";
  const std::string t = trim(text);
  size_t n = 0;
  while (n < t.size() && std::isdigit(static_cast<unsigned char>(t[n]))) ++n;
  if (n == 0) return false;
  if (n < t.size() && t[n] == '.') {
    const size_t frac = n + 1;
    n = frac;
    while (n < t.size() && std::isdigit(static_cast<unsigned char>(t[n]))) ++n;
    if (n == frac) return false;
  }
  double number = 0;
  auto [p, ec] = std::from_chars(t.data(), t.data() + n, number);
  if (ec != std::errc() || p != t.data() + n || !std::isfinite(number)) return false;
  const std::string suffix = lower(trim(t.substr(n)));
  if (suffix == "ms") {
    number /= 1000.0;
  } else if (!suffix.empty() && suffix != "s") {
    return false;
  }
  out = number;
  return true;
}

bool parse_threads(const std::string& text, uint32_t& out, std::string& why) {
  why = "expected a whole number from 1 to " + std::to_string(kMaxThreads);
  uint64_t v = 0;
  if (!parse_uint(text, kMaxThreads, v) || v == 0) return false;
  out = static_cast<uint32_t>(v);
  return true;
}

bool parse_aligned_size(const std::string& text, uint64_t max, uint64_t& out, std::string& why) {
  uint64_t v = 0;
  if (!parse_size(text, v, why)) return false;
  if (v == 0 || v % kAlign != 0 || v > max) {
    why = "must be a positive multiple of 4096 bytes";
    if (max != std::numeric_limits<uint64_t>::max()) why += " and at most 1GiB";
    return false;
  }
  out = v;
  return true;
}

bool parse_positive_duration(const std::string& text, double& out, std::string& why) {
  double s = 0;
  if (!parse_duration(text, s, why)) return false;
  if (!(s > 0)) {
    why = "must be greater than 0";
    return false;
  }
  out = s;
  return true;
}

// Empty `why` when fine. A prefix becomes part of a file name inside the
// checkpoint directory, so anything that could leave it or need quoting is out.
std::string filename_prefix_problem(const std::string& v) {
  if (v.empty()) return "must not be empty";
  for (unsigned char c : v) {
    if (c == '/' || c == '\\') return "must not contain a path separator";
    if (!std::isalnum(c) && c != '.' && c != '_' && c != '-')
      return "may only contain A-Z, a-z, 0-9, '.', '_' and '-'";
  }
  if (v.find("..") != std::string::npos) return "must not contain '..'";
  return "";
}

constexpr int kDefaultZstdLevel = 3;

bool parse_compress_value(const std::string& text, std::string& out, std::string& why) {
  why = "expected none, false, true, zstd or zstd:<level> with level 1 to 22";
  const std::string t = lower(trim(text));
  bool flag = false;
  std::string ignored;
  if (parse_bool(t, flag, ignored) || t == "none") {
    out = flag ? "zstd:" + std::to_string(kDefaultZstdLevel) : "none";
    return true;
  }
  if (t == "zstd") {
    out = "zstd:" + std::to_string(kDefaultZstdLevel);
    return true;
  }
  const std::string head = "zstd:";
  if (t.compare(0, head.size(), head) != 0) return false;
  uint64_t level = 0;
  if (!parse_uint(t.substr(head.size()), 22, level) || level == 0) return false;
  out = head + std::to_string(level);
  return true;
}

// ---- the key table ----

using ApplyFn = bool (*)(const std::string& value, Options& out, std::string& why);

struct KeySpec {
  OptionInfo info;
  ApplyFn apply;
};

// The order is the order of option_infos() and of config/ferry.ini.
const std::vector<KeySpec>& key_table() {
  static const std::vector<KeySpec> kTable = {
      {{"root", "", "checkpoint directory; empty means every save and load must name one"},
       [](const std::string& v, Options& o, std::string&) {
         o.root = v;
         return true;
       }},
      {{"pool-bytes", "auto",
        "pinned staging pool per rank; at least chunk-bytes; or auto[:CAP]: sized from the "
        "first save's (or load's) state, growing with larger ones up to CAP (default 1GiB)"},
       [](const std::string& v, Options& o, std::string& why) {
         std::string size = v;
         const bool is_auto = lower(v.substr(0, 4)) == "auto";
         if (is_auto) {
           if (v.size() == 4) {
             o.pool_bytes = kDefaultPoolCap;
             o.pool_auto = true;
             return true;
           }
           if (v[4] != ':') {
             why = "expected a size, auto or auto:CAP";
             return false;
           }
           size = v.substr(5);
         }
         uint64_t n = 0;
         if (!parse_size(size, n, why)) return false;
         if (n == 0) {
           why = "must be positive";
           return false;
         }
         o.pool_bytes = n;
         o.pool_auto = is_auto;
         return true;
       }},
      {{"chunk-bytes", "auto",
        "pool block size and size of one data write; a multiple of 4096, at most 1GiB, or "
        "auto: 32MiB, halved while the pool would hold fewer than 8 blocks (not below 64KiB)"},
       [](const std::string& v, Options& o, std::string& why) {
         if (lower(v) == "auto") {
           o.chunk_bytes = 0;  // sized once pool-bytes is known
           return true;
         }
         return parse_aligned_size(v, kMaxChunkBytes, o.chunk_bytes, why);
       }},
      {{"writers", "2", "writer threads per rank, 1 to 64"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_threads(v, o.writers, why);
       }},
      {{"copy-threads", "2",
        "threads per rank copying host tensors into the staging pool during a snapshot, 1 to 64"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_threads(v, o.copy_threads, why);
       }},
      {{"direct-io", "true",
        "write and load data with O_DIRECT, bypassing the page cache, where the filesystem takes "
        "it"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_bool(v, o.direct_io, why);
       }},
      {{"fsync", "true",
        "fsync data files, the manifest and directories before a checkpoint counts as saved"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_bool(v, o.fsync, why);
       }},
      {{"checksum", "true", "store an xxh3-64 checksum per checksum block and verify it on load"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_bool(v, o.checksum, why);
       }},
      {{"checksum-block-bytes", "1MiB", "bytes covered by one checksum; a multiple of 4096"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_aligned_size(v, std::numeric_limits<uint64_t>::max(), o.checksum_block_bytes,
                                   why);
       }},
      {{"keep-last", "0", "committed checkpoints to keep under root; 0 keeps all"},
       [](const std::string& v, Options& o, std::string& why) {
         why = "expected a whole number, 0 or more (0 keeps all)";
         uint64_t n = 0;
         if (!parse_uint(v, std::numeric_limits<uint32_t>::max(), n)) return false;
         o.keep_last = static_cast<uint32_t>(n);
         return true;
       }},
      {{"fail-fast", "false",
        "a save_async while another save is in flight fails with busy instead of waiting"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_bool(v, o.fail_fast, why);
       }},
      {{"verify-snapshot", "false",
        "checksum each host tensor before and after its snapshot copy; a tensor changed "
        "meanwhile fails the save (always on in debug builds)"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_bool(v, o.verify_snapshot, why);
       }},
      {{"lease-seconds", "30",
        "lease on a pending checkpoint directory; after it a crashed save may be cleaned up"},
       [](const std::string& v, Options& o, std::string& why) {
         double s = 0;
         if (!parse_duration(v, s, why)) return false;
         if (!(s > 0)) {
           why = "must be greater than 0";
           return false;
         }
         o.lease_seconds = s;
         return true;
       }},
      {{"readers", "auto",
        "reader threads per rank for load, 1 to 64, or auto: 1 where the process may run on 2 "
        "CPUs or fewer (two readers there keep both busy, and the disk's own work waits), else 2"},
       [](const std::string& v, Options& o, std::string& why) {
         if (lower(v) == "auto") {
           o.readers = 0;  // the loader counts the CPUs it may run on
           return true;
         }
         if (!parse_threads(v, o.readers, why)) {
           why += ", or auto";
           return false;
         }
         return true;
       }},
      {{"read-into-tensors", "true",
        "load reads large host tensors whose memory and file offset O_DIRECT accepts straight "
        "into them, without a staging copy; false stages every read (faster on virtual disks "
        "that split reads into scattered pages)"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_bool(v, o.read_into_tensors, why);
       }},
      {{"share-window", "8MiB",
        "most bytes of replicated load data one rank sends another before the other has taken "
        "them; bounds the memory of the ranks (rank 0 relays); a multiple of 4096, at most 1GiB"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_aligned_size(v, kMaxChunkBytes, o.share_window_bytes, why);
       }},
      {{"share-memory", "true",
        "ranks of one node pass the replicated load data they read for each other through "
        "shared memory (a memfd each receiver offers, mapped by its senders through /proc, and "
        "kept between loads: share-window plus a frame per local sender); false, or a rank that "
        "cannot map its peer's, sends it over the lanes"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_bool(v, o.share_memory, why);
       }},
      {{"load-sharing", "node",
        "who reads replicated load data once: node (each node reads it, its ranks share it) or "
        "job (one host reads each range from storage and sends it to the other hosts over the "
        "network, under share-window; for storage slower than the network); the same on every "
        "rank"},
       [](const std::string& v, Options& o, std::string& why) {
         const std::string l = lower(v);
         if (l != "node" && l != "job") {
           why = "expected node or job";
           return false;
         }
         o.load_sharing_job = l == "job";
         return true;
       }},
      {{"direct-lanes", "tcp",
        "how ranks of one node reach each other besides through rank 0: tcp (UCX endpoints "
        "closed by force when a peer fails), shm (UCX may use shared memory) or off (rank 0 "
        "relays every frame between the others); two ranks get a lane only if both ask for the "
        "same"},
       [](const std::string& v, Options& o, std::string& why) {
         const std::string l = lower(v);
         if (l != "tcp" && l != "shm" && l != "off") {
           why = "expected tcp, shm or off";
           return false;
         }
         o.direct_lanes = l;
         return true;
       }},
      {{"lane-info", "false", "log the UCX transports of each direct lane as it comes up"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_bool(v, o.lane_info, why);
       }},
      {{"coordinator-address", "", "address of rank 0; empty means MASTER_ADDR, else 127.0.0.1"},
       [](const std::string& v, Options& o, std::string&) {
         o.coordinator_address = v;
         return true;
       }},
      {{"port", "0", "port rank 0 listens on for the other ranks; 0 means MASTER_PORT + 1"},
       [](const std::string& v, Options& o, std::string& why) {
         why = "expected a port number from 0 to 65535";
         uint64_t n = 0;
         if (!parse_uint(v, 65535, n)) return false;
         o.port = static_cast<uint32_t>(n);
         return true;
       }},
      {{"connect-timeout", "60s", "how long ranks wait for each other at start"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_positive_duration(v, o.connect_timeout_s, why);
       }},
      {{"heartbeat-interval", "1s", "how often ranks tell each other they are alive"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_positive_duration(v, o.heartbeat_interval_s, why);
       }},
      {{"heartbeat-timeout", "10s", "a rank silent this long is failed (catches a hung process)"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_positive_duration(v, o.heartbeat_timeout_s, why);
       }},
      {{"rejoin-timeout", "300s",
        "a rank > 0 whose rank 0 failed asks to rejoin this long, then gives rank 0 up as lost"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_positive_duration(v, o.rejoin_timeout_s, why);
       }},
      {{"plan-timeout", "30s",
        "time for every rank's local plan to reach rank 0 after the first; a save some ranks "
        "never call fails after it, naming them"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_positive_duration(v, o.plan_timeout_s, why);
       }},
      {{"write-timeout", "600s", "time for every rank to write and fsync its files"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_positive_duration(v, o.write_timeout_s, why);
       }},
      {{"commit-timeout", "60s", "time for rank 0 to write the manifest and commit"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_positive_duration(v, o.commit_timeout_s, why);
       }},
      {{"owner-policy", "balanced",
        "who writes replicated tensors: balanced (spread over ranks) or lowest-rank"},
       [](const std::string& v, Options& o, std::string& why) {
         why = "expected balanced or lowest-rank";
         if (v == "balanced") {
           o.owner_lowest_rank = false;
         } else if (v == "lowest-rank") {
           o.owner_lowest_rank = true;
         } else {
           return false;
         }
         return true;
       }},
      {{"replica-check", "auto",
        "before the commit, every holder of a replicated tensor (same key and box on several "
        "ranks, written once) hashes its bytes and rank 0 compares: a mismatch fails the save "
        "naming the key and ranks. full hashes every byte, sampled the size and 64 windows of "
        "4KiB, auto is full up to 64MiB per tensor and sampled above, off skips the check"},
       [](const std::string& v, Options& o, std::string& why) {
         why = "expected auto, full, sampled or off";
         const std::string t = lower(trim(v));
         if (t == "auto")
           o.replica_check = ReplicaCheck::automatic;
         else if (t == "full")
           o.replica_check = ReplicaCheck::full;
         else if (t == "sampled")
           o.replica_check = ReplicaCheck::sampled;
         else if (t == "off")
           o.replica_check = ReplicaCheck::off;
         else
           return false;
         return true;
       }},
      {{"cuda-register-pool", "true",
        "pin the staging pool with cudaHostRegister when a GPU is used; false allows pageable "
        "(slower) device copies where pinning is refused"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_bool(v, o.cuda_register_pool, why);
       }},
      {{"filename-prefix", "rank",
        "data files are named <prefix>-<rank>-<k>.<ext>; only A-Z a-z 0-9 . _ - and no '..'"},
       [](const std::string& v, Options& o, std::string& why) {
         why = filename_prefix_problem(v);
         if (!why.empty()) return false;
         o.filename_prefix = v;
         return true;
       }},
      {{"shard-size", "unlimited",
        "most bytes per data file (e.g. 1GiB); a rank's items spread over several files and a "
        "larger item is split across them; unlimited means one file per rank"},
       [](const std::string& v, Options& o, std::string& why) {
         if (lower(trim(v)) == "unlimited") {
           o.shard_size = 0;
           return true;
         }
         uint64_t n = 0;
         if (!parse_size(v, n, why)) return false;
         if (n == 0) {
           why = "must be positive (or unlimited)";
           return false;
         }
         o.shard_size = n;
         return true;
       }},
      {{"compress", "none",
        "compress data files: none, true (= zstd), zstd or zstd:<level> (1 to 22); compressed "
        "files are .ferryz, not safetensors"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_compress_value(v, o.compress, why);
       }},
      {{"s3-endpoint", "",
        "the S3 server of s3:// roots (http://host:port or https://host); empty means AWS "
        "(https://s3.<region>.amazonaws.com)"},
       [](const std::string& v, Options& o, std::string& why) {
         const std::string e = trim(v);
         if (!e.empty() && e.rfind("http://", 0) != 0 && e.rfind("https://", 0) != 0) {
           why = "must start with http:// or https://";
           return false;
         }
         o.s3_endpoint = e;
         return true;
       }},
      {{"s3-region", "",
        "the region s3:// requests are signed for; empty means AWS_REGION, else us-east-1"},
       [](const std::string& v, Options& o, std::string& why) {
         const std::string r = trim(v);
         for (char c : r)
           if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-') {
             why = "a region is letters, digits and '-' (e.g. eu-west-1)";
             return false;
           }
         o.s3_region = r;
         return true;
       }},
      {{"s3-addressing", "path",
        "how s3:// requests name the bucket: path (host/bucket/key) or virtual "
        "(bucket.host/key)"},
       [](const std::string& v, Options& o, std::string& why) {
         const std::string a = lower(trim(v));
         if (a != "path" && a != "virtual") {
           why = "must be path or virtual";
           return false;
         }
         o.s3_virtual_addressing = a == "virtual";
         return true;
       }},
      {{"s3-parts-in-flight", "8",
        "parts of s3:// data objects a rank sends at once (and connections it keeps for "
        "them), 1 to 64"},
       [](const std::string& v, Options& o, std::string& why) {
         return parse_threads(v, o.s3_parts_in_flight, why);
       }},
      {{"trace-dir", "",
        "rank 0 writes a timeline of each save and load here (every rank's phases on one clock, "
        "Chrome trace event JSON that Perfetto opens, the slowest rank named); empty means off. "
        "A directory it cannot write costs a warning, never the save"},
       [](const std::string& v, Options& o, std::string& why) {
         why = trace_dir_problem(v);
         if (!why.empty()) {
           why = "expected " + why;
           return false;
         }
         o.trace_dir = v;
         return true;
       }},
  };
  return kTable;
}

const KeySpec* find_key(const std::string& key) {
  for (const auto& spec : key_table()) {
    if (key == spec.info.key) return &spec;
  }
  return nullptr;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// The likely intended key for a misspelt one: snake_case, wrong case, a
// doubled "ferry." prefix, or a near miss. Empty when nothing is close.
std::string suggest_key(const std::string& key) {
  std::string k = lower(key);
  std::replace(k.begin(), k.end(), '_', '-');
  const std::string prefix = "ferry.";
  if (k.compare(0, prefix.size(), prefix) == 0) k = k.substr(prefix.size());
  if (find_key(k)) return k;
  std::string best;
  size_t best_d = 3;  // more than two edits away is a different word
  for (const auto& spec : key_table()) {
    const size_t d = edit_distance(k, spec.info.key);
    if (d < best_d) {
      best_d = d;
      best = spec.info.key;
    }
  }
  return best;
}

std::string known_keys() {
  std::string out;
  for (const auto& spec : key_table()) {
    if (!out.empty()) out += ", ";
    out += spec.info.key;
  }
  return out;
}

std::string from(const std::string& origin) {
  return " (from " + (origin.empty() ? std::string("an unnamed source") : origin) + ")";
}

}  // namespace

Status check_filename_prefix(const std::string& prefix, const std::string& option) {
  const std::string why = filename_prefix_problem(prefix);
  if (why.empty()) return Status();
  return Status::invalid_argument(option + " = " + quote_value(prefix) + ": " + why);
}

Result<std::string> parse_compress(const std::string& value, const std::string& option) {
  std::string out, why;
  if (!parse_compress_value(value, out, why))
    return Status::invalid_argument(option + " = " + quote_value(value) + ": " + why);
  return out;
}

const std::vector<OptionInfo>& option_infos() {
  static const std::vector<OptionInfo> kInfos = [] {
    std::vector<OptionInfo> infos;
    for (const auto& spec : key_table()) infos.push_back(spec.info);
    return infos;
  }();
  return kInfos;
}

Result<Options> resolve_options(const std::vector<Setting>& settings) {
  Options opts;
  opts.chunk_bytes = 0;   // auto, unless a setting names a size
  opts.pool_auto = true;  // likewise
  // Where pool-bytes and chunk-bytes last came from, for the cross-key check.
  std::pair<std::string, std::string> pool_src{find_key("pool-bytes")->info.default_value,
                                               "default"};
  std::pair<std::string, std::string> chunk_src{find_key("chunk-bytes")->info.default_value,
                                                "default"};

  for (const Setting& s : settings) {
    const KeySpec* spec = find_key(s.key);
    if (!spec) {
      std::string msg =
          "unknown key ferry." + s.key + " = " + quote_value(s.value) + from(s.origin);
      const std::string hint = suggest_key(s.key);
      if (!hint.empty()) msg += ": did you mean " + hint + "?";
      return Status::invalid_argument(msg + "; known keys: " + known_keys());
    }
    std::string why;
    if (!spec->apply(s.value, opts, why)) {
      return Status::invalid_argument("ferry." + s.key + " = " + quote_value(s.value) +
                                      from(s.origin) + ": " + why);
    }
    if (s.key == "pool-bytes") pool_src = {s.value, s.origin};
    if (s.key == "chunk-bytes") chunk_src = {s.value, s.origin};
  }

  // Checked after all sources so that raising both in different files works.
  if (opts.chunk_bytes == 0) {
    uint64_t c = kAutoChunkBytes;
    while (c > kMinAutoChunkBytes && c * kMinAutoBlocks > opts.pool_bytes) c /= 2;
    opts.chunk_bytes = c;
    chunk_src.first = "auto (" + std::to_string(c / kKiB) + "KiB)";
  }
  if (opts.pool_bytes < opts.chunk_bytes) {
    return Status::invalid_argument(
        "ferry.pool-bytes = " + quote_value(pool_src.first) + from(pool_src.second) +
        " is smaller than ferry.chunk-bytes = " + quote_value(chunk_src.first) +
        from(chunk_src.second) + ": the pool must hold at least one chunk");
  }
  return opts;
}

Result<Options> load_options(const std::vector<Setting>& code, const std::string& config_file,
                             std::string* actor_config) {
  std::vector<Setting> all;
  auto append = [&all](std::vector<Setting>&& more) {
    all.insert(all.end(), std::make_move_iterator(more.begin()),
               std::make_move_iterator(more.end()));
  };
  // The file that is also CAF's: its bytes are read here, once.
  auto read_actor_config = [&](const std::string& path, const std::string& what) -> Status {
    FERRY_ASSIGN_OR_RETURN(std::string text, read_ini_text(path, what));
    FERRY_ASSIGN_OR_RETURN(auto file, parse_ini_settings(text, path));
    append(std::move(file));
    if (actor_config) *actor_config = std::move(text);
    return Status::ok_status();
  };

  if (actor_config) actor_config->clear();
  if (!config_file.empty()) {
    FERRY_RETURN_IF_ERROR(read_actor_config(config_file, "--config-file " + config_file));
  } else {
    // CAF skips its default file silently when absent; so does Ferry.
    const std::string kDefault = "caf-application.ini";
    std::error_code ec;
    if (std::filesystem::exists(kDefault, ec))
      FERRY_RETURN_IF_ERROR(read_actor_config(kDefault, "config file " + kDefault));
  }

  const char* env = std::getenv("FERRY_CONFIG");
  if (env && *env) {
    const std::string origin = std::string("FERRY_CONFIG=") + env;
    FERRY_ASSIGN_OR_RETURN(auto file, read_ini_file(env, origin, origin));
    append(std::move(file));
  }

  all.insert(all.end(), code.begin(), code.end());
  return resolve_options(all);
}

Result<Options> load_options(const std::vector<Setting>& code, const std::string& config_file) {
  return load_options(code, config_file, nullptr);
}

Result<uint64_t> parse_size(const std::string& text) {
  auto size = size_from_text(text);
  if (!size.ok())
    return Status::invalid_argument("'" + text + "' is not a size: " + size.status().message());
  return size;
}

}  // namespace ferry
