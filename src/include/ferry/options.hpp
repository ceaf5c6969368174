// Ferry's settings. They come from, highest first: code (RuntimeArgs::
// settings), the file named by FERRY_CONFIG, the actor config file
// (caf-application.ini in the working directory or --config-file=PATH), each
// a [ferry] section of key = value lines. All three go through the same
// validator, since CAF 0.17 silently drops INI values it cannot parse.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ferry/export_macro.hpp"
#include "ferry/status.hpp"

namespace ferry {

// replica-check: how the holders of a replicated item prove they hold the
// same bytes before the commit (each hashes its copy; rank 0 compares).
enum class ReplicaCheck : uint8_t {
  automatic,  // auto: full for items up to kReplicaCheckFullBytes, sampled above
  full,       // every byte
  sampled,    // the size and 64 windows of 4 KiB spread over the bytes
  off,
};
constexpr uint64_t kReplicaCheckFullBytes = 64ull << 20;

struct Options {
  std::string root;                  // root: checkpoint directory ("" = must be given per call)
  uint64_t pool_bytes = 1ull << 30;  // pool-bytes: staging pool size (auto: its cap)
  bool pool_auto = false;            // pool-bytes = auto (the parsed default): used as states need
  uint64_t chunk_bytes = 32ull << 20;          // chunk-bytes: pool block = write size
  uint32_t writers = 2;                        // writers: writer threads per rank
  uint32_t copy_threads = 2;                   // copy-threads: snapshot copies of host tensors
  bool direct_io = true;                       // direct-io: O_DIRECT data writes and load reads
  bool fsync = true;                           // fsync: data, manifest, directories
  bool checksum = true;                        // checksum: xxh3-64 per checksum block
  uint64_t checksum_block_bytes = 1ull << 20;  // checksum-block-bytes
  uint32_t keep_last = 0;                      // keep-last: retention, 0 keeps all
  bool fail_fast = false;                      // fail-fast: 2nd save_async fails instead of waiting
  // verify-snapshot: xxh3 of each host tensor's bytes before and after its
  // snapshot copy; a change fails the save naming the tensor. Debug builds
  // (NDEBUG not defined) always do it.
  bool verify_snapshot = false;
  double lease_seconds = 30.0;  // lease-seconds: pending directory lease
  uint32_t readers = 0;  // readers: reader threads for load; 0 = auto (1 on <= 2 CPUs, else 2)
  bool read_into_tensors = true;  // read-into-tensors: load reads straight into aligned tensors
  // share-window: most bytes of a load's shared (replicated) data one rank
  // has sent another and not yet heard taken; bounds every queue on the way.
  uint64_t share_window_bytes = 8ull << 20;
  // share-memory: ranks of one node pass those bytes through shared memory
  // (a ring each receiver offers), not over the network.
  bool share_memory = true;
  // load-sharing: who reads replicated load data once: each node (false,
  // "node") or the whole job (true, "job": one host reads each range from
  // storage and sends it to the others over the network).
  bool load_sharing_job = false;
  // direct-lanes: how ranks of one node reach each other besides through
  // rank 0: "tcp" (UCX over tcp, closed by force when a peer fails), "shm"
  // (UCX may use shared memory) or "off" (rank 0 relays); the same on both
  // ends of a lane.
  std::string direct_lanes = "tcp";
  bool lane_info = false;  // lane-info: log the UCX transports of each lane as it comes up
  // Many ranks (torchrun-style environment fills what is left unset).
  std::string coordinator_address;  // coordinator-address: "" = MASTER_ADDR, else 127.0.0.1
  uint32_t port = 0;                // port: rank 0 listens here; 0 = MASTER_PORT + 1
  double connect_timeout_s = 60;    // connect-timeout: ranks wait this long for each other
  double heartbeat_interval_s = 1;  // heartbeat-interval
  double heartbeat_timeout_s = 10;  // heartbeat-timeout: a silent peer is failed after it
  double rejoin_timeout_s = 300;    // rejoin-timeout: a failed rank 0 is asked back this long
  double plan_timeout_s = 30;       // plan-timeout: all local plans in
  double write_timeout_s = 600;     // write-timeout: all write results in
  double commit_timeout_s = 60;     // commit-timeout: manifest, renames, LATEST
  bool owner_lowest_rank = false;   // owner-policy: "balanced" (default) or "lowest-rank"
  ReplicaCheck replica_check = ReplicaCheck::automatic;  // replica-check: auto|full|sampled|off
  // GPU: an unpinnable pool is an error at start unless this is false.
  bool cuda_register_pool = true;  // cuda-register-pool
  // Data files. Each of these is also a SaveOptions field for one save.
  std::string filename_prefix =
      "rank";                     // filename-prefix: data files are <prefix>-<rank>-<k>.<ext>
  uint64_t shard_size = 0;        // shard-size: most bytes per data file; 0 = no cap
  std::string compress = "none";  // compress: none, zstd or zstd:<level> (normalized)
  // s3:// roots (credentials only from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
  // AWS_SESSION_TOKEN: never in a file Ferry reads or prints).
  std::string s3_endpoint;             // s3-endpoint: "" = https://s3.<region>.amazonaws.com
  std::string s3_region;               // s3-region: "" = AWS_REGION, else us-east-1
  bool s3_virtual_addressing = false;  // s3-addressing: path (default) or virtual
  uint32_t s3_parts_in_flight = 8;     // s3-parts-in-flight: 1 to 64 per rank
  // trace-dir: rank 0 writes each save's and load's timeline (every rank's
  // phases, Chrome trace event JSON) here; "" = off.
  std::string trace_dir;
};

// Checks a data file name prefix: not empty, only [A-Za-z0-9._-], no "..".
// Errors are invalid_argument naming `option` (the config key or field).
FERRY_EXPORT Status check_filename_prefix(const std::string& prefix, const std::string& option);
// Parses a compress value: false/none/off/0, true/on/1 (= zstd at the default
// level 3), zstd, or zstd:<level> with level 1 to 22. Returns the normalized
// form ("none", "zstd:<level>"); errors name `option`.
FERRY_EXPORT Result<std::string> parse_compress(const std::string& value,
                                                const std::string& option);

// key = value, as read from one source (the value unquoted).
struct Setting {
  std::string key;  // without the "ferry." prefix
  std::string value;
  std::string origin;  // "code", "FERRY_CONFIG=/x.ini:12", "caf-application.ini:3"
};

// Every key with its default and a one-line description, in file order
// (what `ferry config` prints and config/ferry.ini documents).
struct OptionInfo {
  const char* key;
  const char* default_value;
  const char* help;
};
FERRY_EXPORT const std::vector<OptionInfo>& option_infos();

// Applies settings in order (later wins) on top of the defaults. An unknown
// key or a bad value is invalid_argument naming the key, the value and where
// it came from. Sizes accept suffixes: 4096, 8MiB, 1GiB, 512KB; booleans
// true/false/on/off/1/0; durations in seconds (2.5, "30s", "500ms").
FERRY_EXPORT Result<Options> resolve_options(const std::vector<Setting>& settings);

// Reads the [ferry] section of an INI file (CAF syntax: `;` comments, quoted
// strings, `ferry.key = v` at top level also accepted). A missing file is
// not_found; a syntax error is invalid_argument naming file and line.
FERRY_EXPORT Result<std::vector<Setting>> read_ini_settings(const std::string& path);
// The same, from text (origin names the source in errors).
FERRY_EXPORT Result<std::vector<Setting>> parse_ini_settings(const std::string& text,
                                                             const std::string& origin);

// The whole precedence chain. `config_file` is the explicit --config-file
// (must exist) or "" for caf-application.ini in the working directory
// (skipped when absent); FERRY_CONFIG is read from the environment.
FERRY_EXPORT Result<Options> load_options(const std::vector<Setting>& code,
                                          const std::string& config_file);

}  // namespace ferry
