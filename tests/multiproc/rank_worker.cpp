// One rank of a multi-process test job, started by `ferry launch`. It builds
// a deterministic, sharded synthetic model whose every element is a function
// of (tensor, global index, seed), so any rank count and any sharding can
// check what it loads without a reference copy.
//
//   rank_worker --mode save|load|mismatch|kill --root DIR [--step S] [--seed X]
//               [--layout save|swap|full] [--many N] [--kill-rank R]
//               [--kill-after plan|snapshot|load|none] [--set key=value]...
//               [--step-for-rank R=S] [--root-for-rank R=DIR]   (ranks that disagree)
//               [--evict 1]  (load: drop the checkpoint from the page cache first)
//               [--bad-for-rank R]  (save: first a save where rank R alone passes a
//               bad shard_size; every rank must fail naming it, then save again)
//               [--leave-rank R]  (save: rank R exits after the save; the others
//               save again, which must fail at once naming it)
//               [--big-mib N]  (one more replicated f32 tensor, "rep_huge", of N MiB)
//               [--overwrite 1]  (save: replace the step if it is committed)
//               [--wait-for FILE]  (save: once joined, print READY and wait until
//               FILE exists before the save; a test acts on the running job first)
//               [--then-wait-for FILE]  (save: a save that fails is reported, and
//               once FILE exists the same job saves step S+1: the job survives it)
//   rank_worker --mode replica-differ --root DIR [--differ-rank R] [--differ-key K]
//               (rank R changes one byte of replicated tensor K, default
//               layers.0.bias: the save must fail naming K)
//   rank_worker --mode rank0-only --root DIR [--step S]
//               (only rank 0 calls save; the others wait until it has its
//               answer, which must be an error)
//   rank_worker --mode save|load ... --per-rank 1 [--saved-world N] [--on-resize error|first]
//               (one more entry, per-rank "rng", 16 bytes of its rank's own; a
//               load checks it got its own, or rank 0's after a resize with
//               first, or that error refused naming the key and world sizes)
// A load prints LOADSTATS with its LoadReport figures, the bytes this process
// read from disk (/proc/self/io read_bytes) and how much its peak resident
// memory (VmHWM) grew during the load.
//   rank_worker --mode planner|planner-skip --root DIR [--skip-rank R] [--fn write|raise]
//               (the save in SavePlanner's steps; planner-skip: rank R never
//               calls barrier(), and every rank must see the checkpoint fail)
//               [--bad-for-rank R=prefix|shard|transform] (rank R alone passes
//               a bad filename prefix, shard_size 0, or a transform that fails:
//               every rank must fail naming it, then all save again)
// Exit 0 when the mode's expectation holds (for mismatch: the save failed
// with an error naming what it must name; kill: 3 then; disagree: the save
// failed saying the ranks disagree), 1 otherwise.

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <atomic>
#include <thread>

#include "actors/transport.hpp"
#include "ferry/planner.hpp"
#include "ferry/runtime.hpp"
#include "protocol.hpp"
#include "tests/safetensors_writer.hpp"
#include "tools/flags.hpp"

namespace {

struct Spec {
  std::string key;
  ferry::DType dtype;
  std::vector<int64_t> shape;
  char split;  // 'r' rows, 'c' columns, 'x' replicated
};

std::vector<Spec> model(int many, int64_t big_mib) {
  if (big_mib > 0) {
    auto v = model(many, 0);
    v.push_back({"rep_huge", ferry::DType::f32, {big_mib * 256, 1024}, 'x'});
    return v;
  }
  if (many > 0) {
    std::vector<Spec> v;
    for (int i = 0; i < many; ++i)
      v.push_back({"p." + std::to_string(i), ferry::DType::f32, {8 + i % 5, 4}, i % 7 ? 'r' : 'x'});
    return v;
  }
  return {
      {"layers.0.w_row", ferry::DType::f32, {96, 40}, 'r'},
      {"layers.0.w_col", ferry::DType::bf16, {40, 60}, 'c'},
      {"layers.0.bias", ferry::DType::f32, {40}, 'x'},
      {"optimizer.step", ferry::DType::i64, {}, 'x'},
      {"emb", ferry::DType::f16, {64, 24}, 'r'},
      {"rep_big", ferry::DType::f32, {512, 256}, 'x'},
  };
}

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// [begin, end) of part `r` of `n` when `dim` is cut unevenly (part j ~ j+1).
std::pair<int64_t, int64_t> uneven(int64_t dim, int r, int n) {
  const int64_t total = static_cast<int64_t>(n) * (n + 1) / 2;
  auto cut = [&](int j) { return dim * (static_cast<int64_t>(j) * (j + 1) / 2) / total; };
  return {cut(r), cut(r + 1)};
}

struct Local {
  std::vector<uint8_t> bytes;
  std::vector<int64_t> shape, offsets;
};

// This rank's piece of tensor `s` under `split`.
Local piece(const Spec& s, char split, int rank, int world) {
  Local l;
  l.shape = s.shape;
  l.offsets.assign(s.shape.size(), 0);
  if (split == 'r' && !s.shape.empty()) {
    auto [b, e] = uneven(s.shape[0], rank, world);
    l.offsets[0] = b;
    l.shape[0] = e - b;
  } else if (split == 'c' && s.shape.size() >= 2) {
    const int64_t per = (s.shape[1] + world - 1) / world;
    const int64_t b = std::min<int64_t>(s.shape[1], per * rank);
    l.offsets[1] = b;
    l.shape[1] = std::min<int64_t>(s.shape[1], b + per) - b;
  }
  int64_t n = 1;
  for (auto d : l.shape) n *= d;
  l.bytes.resize(n * ferry::dtype_size(s.dtype));
  return l;
}

// Element bytes at every local position, from the global index.
void fill_expected(const Spec& s, size_t k, const Local& l, uint64_t seed,
                   std::vector<uint8_t>& out) {
  out.resize(l.bytes.size());
  const size_t es = ferry::dtype_size(s.dtype);
  const size_t rank = s.shape.size();
  std::vector<int64_t> idx(rank, 0);
  const int64_t n = static_cast<int64_t>(l.bytes.size() / es);
  for (int64_t i = 0; i < n; ++i) {
    int64_t g = 0;
    for (size_t d = 0; d < rank; ++d) g = g * s.shape[d] + l.offsets[d] + idx[d];
    const uint64_t v = mix(seed * 1000003ull + k * 7919ull + static_cast<uint64_t>(g));
    std::memcpy(out.data() + i * es, &v, es);
    for (size_t d = rank; d-- > 0;) {
      if (++idx[d] < l.shape[d]) break;
      idx[d] = 0;
    }
  }
}

// What this process read from block devices so far (0 where /proc lacks it).
uint64_t disk_read_bytes() {
  std::ifstream io("/proc/self/io");
  std::string key;
  uint64_t v = 0;
  while (io >> key >> v)
    if (key == "read_bytes:") return v;
  return 0;
}

// This process's peak resident memory so far, in bytes (VmHWM).
uint64_t peak_rss_bytes() {
  std::ifstream st("/proc/self/status");
  std::string line;
  while (std::getline(st, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  return 0;
}

// Drops every file under `root` from the page cache, so reads go to disk.
void evict(const std::string& root) {
  std::error_code ec;
  for (const auto& e : std::filesystem::recursive_directory_iterator(root, ec)) {
    if (!e.is_regular_file()) continue;
    const int fd = ::open(e.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

// This process's open share rings (memfds named ferry-share-ring), and the
// inode of the last one found.
std::pair<int, uint64_t> share_rings() {
  int n = 0;
  uint64_t inode = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    std::error_code lec;
    const std::string target = std::filesystem::read_symlink(e.path(), lec).string();
    if (lec || target.rfind("/memfd:ferry-share-ring", 0) != 0) continue;
    struct stat st {};
    if (::stat(e.path().c_str(), &st) != 0) continue;
    ++n;
    inode = st.st_ino;
  }
  return {n, inode};
}

std::string arg(int argc, char** argv, const char* name, const char* fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (!std::strcmp(argv[i], name)) return argv[i + 1];
  return fallback;
}

// Rank 1 of --mode garbage: joins with the right token through a bare
// transport, then sends rank 0 frames that must not crash it. Exit 0 when
// rank 0 answered the garbage with error reports.
int send_garbage() {
  const std::string token = std::getenv("FERRY_JOB_TOKEN") ? std::getenv("FERRY_JOB_TOKEN") : "";
  ferry::TransportOptions to;
  to.rank = 1;
  to.world_size = std::stoi(std::getenv("WORLD_SIZE"));
  to.port = static_cast<uint16_t>(std::stoi(std::getenv("MASTER_PORT")) + 1);
  std::atomic<int> reports{0};
  ferry::TransportCallbacks cb;
  cb.on_frame = [&](int32_t, std::string bytes) {
    auto m = ferry::decode_message(bytes);
    if (m.ok() && std::holds_alternative<ferry::AbortMsg>(*m) &&
        !std::get<ferry::AbortMsg>(*m).reason.ok())
      ++reports;
  };
  cb.on_peer_failed = [](int32_t, ferry::Status) {};
  // The job id rank 0 derives from the token (runtime.cpp) is not needed:
  // the garbage is refused before the job id is looked at.
  auto t = ferry::Transport::start(
      to, ferry::encode_message(ferry::JoinMsg{"x", token, 1, to.world_size, "h", getpid()}),
      ferry::encode_message(ferry::HeartbeatMsg{"x", 1, 0}), cb);
  if (!t.ok() || !(*t)->wait_peers(30).ok()) return 1;
  std::string valid = ferry::encode_message(ferry::HeartbeatMsg{"x", 1, 7});
  const std::vector<std::string> frames = {
      "",
      "garbage",
      std::string(100, '\xff'),
      valid.substr(0, valid.size() - 3),
      "FRY1" + std::string(12, '\0') + std::string(64, '\x41'),
  };
  for (const auto& f : frames) (void)(*t)->send(0, f);  // rank 0's reports are the test
  for (int i = 0; i < 100 && reports < 3; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::printf("garbage sent: %zu frames, %d error reports back\n", frames.size(), reports.load());
  (*t)->stop();
  return reports >= 3 ? 0 : 1;
}

// The SavePlanner steps of a save that must commit; prints SAVED path.
int plain_planner_save(ferry::Runtime& rt, const ferry::StateDict& sd) {
  ferry::SavePlanner planner(rt, sd, "rank");
  auto global = planner.create_global_plan();
  if (!global.ok()) {
    std::printf("ERROR plan: %s\n", global.status().to_string().c_str());
    return 1;
  }
  ferry::Status wrote = planner.save_on_this_process((*global)[rt.rank()]).wait();
  auto path = planner.barrier();
  if (!wrote.ok() || !path.ok()) {
    std::printf("ERROR save: %s\n", (wrote.ok() ? path.status() : wrote).to_string().c_str());
    return 1;
  }
  std::printf("SAVED %s\n", path->c_str());
  return 0;
}

// --bad-for-rank R=WHAT: rank R's SavePlanner gets a bad argument. Every rank
// must fail at create_global_plan, naming the option (and, on the others,
// rank R), long before plan-timeout; then the ranks are still in step and
// the next save commits.
int planner_bad_argument(ferry::Runtime& rt, const ferry::StateDict& sd, const std::string& spec) {
  const int rank = rt.rank();
  const int bad_rank = std::stoi(spec);
  const std::string what = spec.substr(spec.find('=') + 1);
  const char* option = what == "prefix"  ? "filename_prefix"
                       : what == "shard" ? "shard_size"
                                         : "transform_local_plan";
  ferry::SavePlannerOptions o;
  std::string prefix = "rank";
  if (rank == bad_rank) {
    if (what == "prefix") prefix = "../elsewhere";
    if (what == "shard") o.save.shard_size = 0;
    if (what == "transform")
      o.transform_local_plan = [](ferry::LocalSavePlan& p) {
        p.items.push_back(p.items.front());  // adds an item: refused
        return ferry::Status();
      };
  }
  const auto t0 = std::chrono::steady_clock::now();
  {
    ferry::SavePlanner planner(rt, sd, prefix, o);
    auto global = planner.create_global_plan();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const std::string msg = global.ok() ? "planned!" : global.status().to_string();
    std::printf("FAILED as expected after %.0f ms: %s\n", ms, msg.c_str());
    const std::string who = "rank " + std::to_string(bad_rank);
    if (global.ok() || msg.find(option) == std::string::npos ||
        (rank != bad_rank && msg.find(who) == std::string::npos)) {
      std::printf("ERROR the error does not name %s and %s\n", option, who.c_str());
      return 1;
    }
  }
  return plain_planner_save(rt, sd);
}

// The committed checkpoint holds exactly the files the ranks' plans name, and
// this rank's files hold exactly the entries its plan puts in them.
std::string check_plan_files(const std::string& dir, const std::vector<ferry::SavePlan>& plans,
                             int rank) {
  std::set<std::string> named, on_disk;
  for (const auto& p : plans) named.insert(p.files.begin(), p.files.end());
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.find(".safetensors") != std::string::npos || name.find(".ferryz") != std::string::npos)
      on_disk.insert(name);
  }
  if (named != on_disk)
    return std::to_string(on_disk.size()) + " data files on disk, the plans name " +
           std::to_string(named.size());
  const ferry::SavePlan& mine = plans[rank];
  std::vector<std::set<std::string>> want(mine.files.size());
  for (const auto& w : mine.writes) {
    std::string entry = mine.items[w.item].key + "@";
    for (size_t i = 0; i < w.offsets.size(); ++i)
      entry += (i ? "," : "") + std::to_string(w.offsets[i]);
    want[w.file].insert(entry);
  }
  for (size_t f = 0; f < mine.files.size(); ++f) {
    std::ifstream in(dir + "/" + mine.files[f], std::ios::binary);
    uint64_t n = 0;
    in.read(reinterpret_cast<char*>(&n), 8);  // little-endian, as the test hosts are
    std::string header(n, '\0');
    in.read(header.data(), static_cast<std::streamsize>(n));
    size_t entries = 0;
    for (size_t at = 0; (at = header.find("\"data_offsets\"", at)) != std::string::npos; ++at)
      ++entries;
    for (const auto& e : want[f])
      if (header.find("\"" + e + "\"") == std::string::npos)
        return mine.files[f] + " lacks planned entry " + e;
    if (entries != want[f].size())
      return mine.files[f] + " holds " + std::to_string(entries) + " entries, the plan " +
             std::to_string(want[f].size());
  }
  return "";
}

// The save in SavePlanner's steps: every rank sees every rank's plan, tries
// another rank's plan (refused), writes its own and meets the others at
// barrier(). Exit 0 when the outcome is the expected one.
int planner_steps(ferry::Runtime& rt, const ferry::StateDict& sd,
                  const std::vector<std::string>& replicated, const std::string& mode, int argc,
                  char** argv) {
  const int rank = rt.rank(), world = rt.world_size();
  const std::string bad_for = arg(argc, argv, "--bad-for-rank", "");
  if (!bad_for.empty()) return planner_bad_argument(rt, sd, bad_for);
  const int skip_rank = std::stoi(arg(argc, argv, "--skip-rank", "1"));
  // --fn write: every rank's file comes from a checkpoint_fn; --fn raise:
  // rank --skip-rank's function throws, and every rank must fail.
  const std::string fn = arg(argc, argv, "--fn", "");
  ferry::SavePlannerOptions o;
  // --owner lowest|balanced: the policy; --owner-for-rank R=P: rank R differs.
  std::string owner = arg(argc, argv, "--owner", "");
  const std::string owner_for = arg(argc, argv, "--owner-for-rank", "");
  if (auto eq = owner_for.find('='); eq != std::string::npos && std::stoi(owner_for) == rank)
    owner = owner_for.substr(eq + 1);
  if (owner == "lowest") o.owner_policy = ferry::OwnerPolicy::lowest_rank;
  if (owner == "balanced") o.owner_policy = ferry::OwnerPolicy::balanced;
  if (!fn.empty())
    o.checkpoint_fn = [fn, rank, skip_rank](const ferry::StateDict& planned,
                                            const std::string& file) -> ferry::Status {
      if (fn == "raise" && rank == skip_rank) throw std::runtime_error("user checkpoint_fn bug");
      std::printf("CHECKPOINT_FN got %zu tensors\n", planned.size());
      return ferry::testing::write_safetensors(planned, file);
    };
  // --compress C, --shard-size SIZE, --prefix P: the file options.
  const std::string compress = arg(argc, argv, "--compress", "");
  const std::string shard = arg(argc, argv, "--shard-size", "");
  if (!compress.empty()) o.save.compress = compress;
  if (!shard.empty())
    o.save.shard_size = ferry::cli::size_flag_or_exit("rank_worker", "--shard-size", shard);
  ferry::SavePlanner planner(rt, sd, arg(argc, argv, "--prefix", "rank"), o);
  auto global = planner.create_global_plan();
  if (!global.ok() && !owner_for.empty()) {
    std::printf("FAILED as expected: %s\n", global.status().to_string().c_str());
    return global.status().message().find("disagree on the owner policy") != std::string::npos ? 0
                                                                                               : 1;
  }
  if (!global.ok() && fn == "raise") {
    // The raising rank may abort the checkpoint before this rank has seen
    // its plan: the save fails here, with the same cause.
    std::printf("FAILED as expected: %s\n", global.status().to_string().c_str());
    return global.status().message().find("user checkpoint_fn bug") != std::string::npos ? 0 : 1;
  }
  if (!global.ok()) {
    std::printf("ERROR plan: %s\n", global.status().to_string().c_str());
    return 1;
  }
  if (static_cast<int>(global->size()) != world) {
    std::printf("ERROR %zu plans for %d ranks\n", global->size(), world);
    return 1;
  }
  if (owner == "lowest") {
    // Every replicated tensor is written by rank 0 alone.
    for (const auto& p : *global)
      for (size_t i = 0; i < p.items.size(); ++i)
        for (const auto& key : replicated)
          if (p.items[i].key == key && p.owners[i] != std::vector<int32_t>{0}) {
            std::printf("ERROR %s is not owned by rank 0 alone\n", key.c_str());
            return 1;
          }
    std::printf("OWNERS lowest rank\n");
  }
  uint64_t total = 0;
  for (const auto& p : *global) total += p.bytes;
  std::printf("PLANNED step %llu: %d plans, %llu bytes in all\n",
              static_cast<unsigned long long>(planner.step()), world,
              static_cast<unsigned long long>(total));
  if (rank == 0) std::printf("%s", (*global)[world - 1].to_string().c_str());
  const auto& other = (*global)[(rank + 1) % world];
  ferry::Status refused = planner.save_on_this_process(other).wait();
  if (world > 1) {
    if (refused.ok()) {
      std::printf("ERROR rank %d's plan was accepted on rank %d\n", other.rank, rank);
      return 1;
    }
    std::printf("REFUSED %s\n", refused.to_string().c_str());
  }
  ferry::Status wrote = planner.save_on_this_process((*global)[rank]).wait();
  if (fn == "raise") {
    auto path = planner.barrier();
    std::printf("FAILED as expected: %s\n",
                path.ok() ? "committed!" : path.status().to_string().c_str());
    return !path.ok() && path.status().message().find("user checkpoint_fn bug") != std::string::npos
               ? 0
               : 1;
  }
  if (!wrote.ok()) {
    std::printf("ERROR write: %s\n", wrote.to_string().c_str());
    return 1;
  }
  const auto t0 = std::chrono::steady_clock::now();
  if (mode == "planner-skip" && rank == skip_rank) {
    // Never calls barrier(): the write phase runs out on every rank.
    ferry::Status s = planner.handle().wait_committed();
    std::printf(
        "FAILED as expected (skipped barrier) after %.0f ms: %s\n",
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(),
        s.to_string().c_str());
    return s.ok() ? 1 : 0;
  }
  auto path = planner.barrier();
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (mode == "planner-skip") {
    std::printf("FAILED as expected after %.0f ms: %s\n", ms,
                path.ok() ? "committed!" : path.status().to_string().c_str());
    return path.ok() ? 1 : 0;
  }
  if (!path.ok()) {
    std::printf("ERROR barrier: %s\n", path.status().to_string().c_str());
    return 1;
  }
  std::printf("SAVED %s\n", path->c_str());
  if (std::string why = check_plan_files(*path, *global, rank); !why.empty()) {
    std::printf("ERROR files: %s\n", why.c_str());
    return 1;
  }
  std::printf("FILES as planned\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Line by line to the pipe `ferry launch` reads: a rank that printed its
  // result and is then killed while its runtime shuts down (the launcher
  // stops the others 2 s after the first exits, and closing a lane to a
  // stopped rank can take the transport's 2 s grace) keeps its result.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const std::string mode = arg(argc, argv, "--mode", "save");
  const std::string root = arg(argc, argv, "--root", "");
  const uint64_t step = std::stoull(arg(argc, argv, "--step", "1"));
  const uint64_t seed = std::stoull(arg(argc, argv, "--seed", "1"));
  const std::string layout = arg(argc, argv, "--layout", mode == "load" ? "swap" : "save");
  const int many = std::stoi(arg(argc, argv, "--many", "0"));
  const int kill_rank = std::stoi(arg(argc, argv, "--kill-rank", "1"));
  const std::string kill_after = arg(argc, argv, "--kill-after", "plan");
  // stop: SIGSTOP instead of SIGKILL, a hung process rather than a dead one.
  const int kill_signal = arg(argc, argv, "--kill-signal", "kill") == "stop" ? SIGSTOP : SIGKILL;

  if (mode == "garbage" && std::getenv("RANK") && std::string(std::getenv("RANK")) == "1")
    return send_garbage();

  ferry::RuntimeArgs ra;
  ra.set("root", root).set("pool-bytes", "4MiB").set("chunk-bytes", "256KiB");
  ra.set("checksum-block-bytes", "64KiB").set("heartbeat-interval", "200ms");
  ra.set("heartbeat-timeout", "3s").set("plan-timeout", "20s").set("write-timeout", "30s");
  ra.set("connect-timeout", "30s");
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--set")) continue;
    std::string kv = argv[i + 1];
    auto eq = kv.find('=');
    if (eq != std::string::npos) ra.set(kv.substr(0, eq), kv.substr(eq + 1));
  }
  auto rt_or = ferry::Runtime::from_env(ra);
  if (!rt_or.ok()) {
    std::printf("ERROR start: %s\n", rt_or.status().to_string().c_str());
    return 1;
  }
  auto& rt = *rt_or.value();
  const int rank = rt.rank(), world = rt.world_size();

  const auto specs = model(many, std::stoll(arg(argc, argv, "--big-mib", "0")));
  std::vector<Local> locals;
  ferry::StateDict sd;
  for (size_t k = 0; k < specs.size(); ++k) {
    Spec s = specs[k];
    char split = s.split;
    if (layout == "swap") split = split == 'r' ? 'c' : split == 'c' ? 'r' : 'x';
    if (layout == "full") split = 'x';
    if (mode == "mismatch" && rank == 1 && k == 2) s.dtype = ferry::DType::f64;
    locals.push_back(piece(s, split, rank, world));
  }
  for (size_t k = 0; k < specs.size(); ++k) {
    Spec s = specs[k];
    if (mode == "mismatch" && rank == 1 && k == 2) s.dtype = ferry::DType::f64;
    Local& l = locals[k];
    if (mode != "load") fill_expected(s, k, l, seed, l.bytes);
    if (ferry::Status added = sd.add(s.key, ferry::TensorView(l.bytes.data(), s.dtype, l.shape),
                                     ferry::Shard{s.shape, l.offsets});
        !added.ok()) {
      std::printf("ERROR state dict: %s\n", added.to_string().c_str());
      return 1;
    }
  }

  // --per-rank 1: a per-rank entry, whose bytes name the rank that saved them.
  const bool with_per_rank = arg(argc, argv, "--per-rank", "0") == std::string("1");
  const int saved_world =
      std::stoi(arg(argc, argv, "--saved-world", std::to_string(world).c_str()));
  const bool resize_first = arg(argc, argv, "--on-resize", "error") == std::string("first");
  std::vector<uint8_t> own(16);
  auto per_rank_bytes = [](int r) {
    std::vector<uint8_t> b(16);
    for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(r * 16 + i + 1);
    return b;
  };
  if (with_per_rank) {
    if (mode != "load") own = per_rank_bytes(rank);
    if (ferry::Status added =
            sd.add_per_rank("rng", ferry::TensorView(own.data(), ferry::DType::u8, {16}),
                            resize_first ? ferry::OnResize::first : ferry::OnResize::error);
        !added.ok()) {
      std::printf("ERROR state dict: %s\n", added.to_string().c_str());
      return 1;
    }
  }

  if (mode == "load") {
    // --kill-after load: this rank dies before it loads; the others must fail.
    if (kill_after == "load" && rank == kill_rank) std::raise(kill_signal);
    // Loads `path` into the tensors and checks every byte against `with`'s
    // values; 0 when all are equal.
    auto load_and_check = [&](const std::string& path, uint64_t with) {
      if (arg(argc, argv, "--evict", "0") == std::string("1")) evict(path);
      const uint64_t disk0 = disk_read_bytes();
      const uint64_t hwm0 = peak_rss_bytes();
      const auto load0 = std::chrono::steady_clock::now();
      auto report = rt.load_report(sd, path);
      const double load_s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - load0).count();
      if (!report.ok() && with_per_rank && saved_world != world && !resize_first) {
        std::printf("REFUSED as expected: %s\n", report.status().to_string().c_str());
        return report.status().message().find("tensor 'rng' is per-rank: saved by " +
                                              std::to_string(saved_world) + " ranks, loaded by " +
                                              std::to_string(world)) != std::string::npos
                   ? 0
                   : 1;
      }
      if (!report.ok()) {
        std::printf("ERROR load: %s\n", report.status().to_string().c_str());
        return 1;
      }
      if (with_per_rank) {
        const int from = saved_world == world ? rank : 0;
        if (own != per_rank_bytes(from)) {
          std::printf("ERROR per-rank rng of rank %d is not rank %d's value\n", rank, from);
          return 1;
        }
        std::printf("PERRANK rank %d got rank %d's value\n", rank, from);
        if (!report->not_restored.empty()) {
          std::printf("ERROR not restored: %s\n", report->not_restored.front().c_str());
          return 1;
        }
      }
      std::printf(
          "LOADSTATS read=%llu received=%llu disk=%llu queued=%llu hwm_growth=%llu relayed=%llu "
          "in_memory=%llu fetched=%llu hosts_sent=%llu load_s=%.3f\n",
          static_cast<unsigned long long>(report->bytes_read),
          static_cast<unsigned long long>(report->bytes_received),
          static_cast<unsigned long long>(disk_read_bytes() - disk0),
          static_cast<unsigned long long>(report->send_queue_peak),
          static_cast<unsigned long long>(peak_rss_bytes() - hwm0),
          static_cast<unsigned long long>(report->share_frames_relayed),
          static_cast<unsigned long long>(report->shared_in_memory),
          static_cast<unsigned long long>(report->bytes_fetched),
          static_cast<unsigned long long>(report->bytes_sent_to_hosts), load_s);
      std::string peers;
      for (int32_t p : report->share_ring_peers)
        peers += (peers.empty() ? "" : ",") + std::to_string(p);
      std::printf("RINGPEERS node=%s peers=%s\n", report->node.c_str(), peers.c_str());
      const auto [rings, inode] = share_rings();
      std::printf("RINGS open=%d inode=%llu\n", rings, static_cast<unsigned long long>(inode));
      std::vector<uint8_t> expect;
      for (size_t k = 0; k < specs.size(); ++k) {
        fill_expected(specs[k], k, locals[k], with, expect);
        if (expect != locals[k].bytes) {
          // Where it differs tells a wrong place from a wrong byte.
          const size_t n = std::min(expect.size(), locals[k].bytes.size());
          size_t first = 0, last = n;
          while (first < n && expect[first] == locals[k].bytes[first]) ++first;
          while (last > first && expect[last - 1] == locals[k].bytes[last - 1]) --last;
          std::printf("ERROR tensor %s differs from what was saved (bytes %zu to %zu of %zu)\n",
                      specs[k].key.c_str(), first, last, expect.size());
          return 1;
        }
      }
      std::printf("LOADED %zu tensors, every byte equal\n", specs.size());
      return 0;
    };
    // --root-for-rank R=PATH: rank R loads PATH instead (ranks that disagree).
    std::string path = root;
    const std::string path_for = arg(argc, argv, "--root-for-rank", "");
    if (auto eq = path_for.find('='); eq != std::string::npos && std::stoi(path_for) == rank)
      path = path_for.substr(eq + 1);
    if (load_and_check(path, seed) != 0) return 1;
    // --again DIR --again-seed S: then the same tensors, filled with other
    // bytes first, from another checkpoint (saved with seed S).
    const std::string again = arg(argc, argv, "--again", "");
    if (again.empty()) return 0;
    for (Local& l : locals) std::fill(l.bytes.begin(), l.bytes.end(), uint8_t{0xEE});
    return load_and_check(again, std::stoull(arg(argc, argv, "--again-seed", "1")));
  }

  if (mode == "planner" || mode == "planner-skip") {
    std::vector<std::string> replicated;
    for (const auto& s : specs)
      if (s.split == 'x') replicated.push_back(s.key);
    return planner_steps(rt, sd, replicated, mode, argc, argv);
  }

  if (mode == "rank0-only") {
    // The `if rank == 0: save` habit: the others stay alive (no "left the
    // job") until rank 0 has its answer, which it leaves in a marker file.
    const std::string marker = root + "/rank0-done";
    if (rank != 0) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
      while (!std::filesystem::exists(marker) && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      std::printf("IDLE rank %d never saved\n", rank);
      return std::filesystem::exists(marker) ? 0 : 1;
    }
    const auto r0 = std::chrono::steady_clock::now();
    ferry::Status st = rt.save_async(sd, step).wait_committed();
    std::printf(
        "FAILED as expected after %.0f ms: %s\n",
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - r0).count(),
        st.to_string().c_str());
    std::ofstream(marker) << "done\n";
    return st.ok() ? 1 : 0;
  }
  if (mode == "replica-differ") {
    const int differ_rank = std::stoi(arg(argc, argv, "--differ-rank", "1"));
    const std::string differ_key = arg(argc, argv, "--differ-key", "layers.0.bias");
    for (size_t k = 0; k < specs.size(); ++k)
      if (specs[k].key == differ_key && rank == differ_rank) locals[k].bytes[1] ^= 0x5a;
  }

  uint64_t my_step = step;
  ferry::SaveOptions so;
  so.overwrite = arg(argc, argv, "--overwrite", "0") == std::string("1");
  const std::string step_for = arg(argc, argv, "--step-for-rank", "");
  if (auto eq = step_for.find('='); eq != std::string::npos && std::stoi(step_for) == rank)
    my_step = std::stoull(step_for.substr(eq + 1));
  const std::string root_for = arg(argc, argv, "--root-for-rank", "");
  if (auto eq = root_for.find('='); eq != std::string::npos && std::stoi(root_for) == rank)
    so.root = root_for.substr(eq + 1);
  const std::string bad_for = arg(argc, argv, "--bad-for-rank", "");
  if (mode == "save" && !bad_for.empty()) {
    // save_async with a bad option on one rank: every rank fails at once,
    // naming it, and the next save commits (the ranks stayed in step).
    const int bad_rank = std::stoi(bad_for);
    ferry::SaveOptions bad = so;
    if (rank == bad_rank) bad.shard_size = -5;
    const auto b0 = std::chrono::steady_clock::now();
    ferry::Status st = rt.save_async(sd, my_step, bad).wait_committed();
    std::printf(
        "FAILED as expected after %.0f ms: %s\n",
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - b0).count(),
        st.to_string().c_str());
    if (st.ok() || st.message().find("shard_size") == std::string::npos ||
        (rank != bad_rank &&
         st.message().find("rank " + std::to_string(bad_rank)) == std::string::npos))
      return 1;
  }
  const auto wait_for_file = [](const std::string& go) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (!std::filesystem::exists(go) && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  };
  if (const std::string go = arg(argc, argv, "--wait-for", ""); !go.empty()) {
    std::printf("READY\n");
    wait_for_file(go);
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto h = rt.save_async(sd, my_step, so);
  // --kill-after none: FERRY_KILL_AT does it, at a step inside the save.
  if (mode == "kill" && rank == kill_rank && kill_after != "none") {
    if (kill_after == "snapshot") (void)h.wait_snapshot();  // dies either way
    std::raise(kill_signal);
  }
  auto st = h.wait_committed();
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (mode == "save") {
    if (!st.ok()) {
      std::printf("ERROR save: %s\n", st.to_string().c_str());
      const std::string go = arg(argc, argv, "--then-wait-for", "");
      if (go.empty()) return 1;
      wait_for_file(go);
      h = rt.save_async(sd, my_step + 1, so);
      st = h.wait_committed();
      if (!st.ok()) {
        std::printf("ERROR next save: %s\n", st.to_string().c_str());
        return 1;
      }
    }
    const auto m = h.metrics();
    std::printf("SAVED %s bytes=%llu total_ms=%.1f plan_ms=%.1f write_ms=%.1f commit_ms=%.1f\n",
                h.path().c_str(), static_cast<unsigned long long>(m.bytes), m.total_ms, m.plan_ms,
                m.write_ms, m.commit_ms);
    const std::string leave = arg(argc, argv, "--leave-rank", "");
    if (leave.empty()) return 0;
    if (rank == std::stoi(leave)) {
      std::printf("LEAVING\n");
      return 0;
    }
    // The rank that left never joins this save: it fails at once, naming it.
    const auto l0 = std::chrono::steady_clock::now();
    ferry::Status again = rt.save_async(sd, my_step + 1, so).wait_committed();
    std::printf(
        "FAILED as expected after %.0f ms: %s\n",
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - l0).count(),
        again.to_string().c_str());
    return !again.ok() &&
                   again.message().find("rank " + leave + " left the job") != std::string::npos
               ? 0
               : 1;
  }
  if (mode == "replica-differ" && st.ok()) {
    std::printf("SAVED despite differing replicas: %s\n", h.path().c_str());
    return 2;
  }
  // mismatch / kill: the save must fail, quickly, naming what failed.
  std::printf("FAILED as expected after %.0f ms: %s\n", ms, st.to_string().c_str());
  if (st.ok()) return 1;
  if (mode == "mismatch") return st.message().find("layers.0.bias") != std::string::npos ? 0 : 1;
  if (mode == "garbage") return 0;  // rank 0 is alive and reports the failed save
  if (mode == "disagree") return st.message().find("disagree") != std::string::npos ? 0 : 1;
  if (mode == "replica-differ")
    return st.message().find("'" + arg(argc, argv, "--differ-key", "layers.0.bias") + "'") !=
                   std::string::npos
               ? 0
               : 1;
  // Exit 3, not 0: an expected failure, but a failure, so that `ferry
  // launch` reaps a rank that was stopped rather than killed.
  return st.message().find("rank " + std::to_string(kill_rank)) != std::string::npos ||
                 st.code() == ferry::StatusCode::outcome_unknown
             ? 3
             : 1;
}
