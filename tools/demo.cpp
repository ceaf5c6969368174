// ferry demo: a synthetic data-parallel + tensor-parallel training job.
//
// Without RANK in the environment it is the driver: it starts N ranks with
// `ferry launch` to train and checkpoint, then M ranks (default N+1) to
// restore the last checkpoint with a different sharding and check every byte.
// With RANK set it is one of those ranks (--role train|restore).
//
// Every element of every tensor is a pure function of (tensor, version,
// global index), and versions follow a fixed schedule, so a restoring rank
// computes what the saved bytes must be for any shard without a reference
// copy.

#include <sys/wait.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <thread>

#include "ferry/catalog.hpp"
#include "ferry/filesystem.hpp"
#include "ferry/runtime.hpp"
#include "tools/commands.hpp"
#include "tools/flags.hpp"

#ifdef FERRY_DEMO_HAVE_CUDA
// bench/gpu_kernels.cu: the CUDA runtime calls and kernels of --device cuda
// (CUDA error codes; 0 is success).
extern "C" {
int ferry_demo_device_count(int* n);
int ferry_demo_set_device(int d);
int ferry_demo_alloc(void** p, size_t bytes);
int ferry_demo_free(void* p);
int ferry_demo_stream(void** s);
int ferry_demo_sync(void* s);
int ferry_demo_fill(void* stream, unsigned int* out, long long rows, long long cols,
                    long long gcols, long long row0, long long col0, unsigned long long seed);
int ferry_demo_set(void* stream, unsigned int* p, unsigned int v);
const char* ferry_demo_error(int err);
}
#endif

namespace ferry::cli {

namespace {

struct DemoFlags {
  uint32_t ranks = 2;
  uint32_t restore_ranks = 0;  // 0: ranks + 1
  uint64_t state_mib = 1024;   // global, over all ranks
  uint32_t layers = 8;
  uint32_t steps = 30;
  uint32_t every = 10;
  std::string root = "ferry-demo-checkpoints";
  std::string device = "host";           // where the training tensors live: host, cuda
  std::string role;                      // "", "train", "restore"
  std::vector<std::string> passthrough;  // --set / --config-file, for the ranks
  std::vector<Setting> settings;
  std::string config_file;
  std::string trace;           // --trace FILE: the last save's timeline goes there
  uint32_t hosts = 0;          // --hosts N: the ranks spread over N emulated hosts
  uint32_t restore_hosts = 0;  // 0: hosts + 1
};

// --- the synthetic model ------------------------------------------------------------

enum class Split { rows, cols, replicated };

struct TensorSpec {
  std::string key;
  DType dtype;
  std::vector<int64_t> shape;  // global
  Split split;
};

// Per layer: a row-sharded and a column-sharded weight (tensor parallel), a
// replicated bias; plus a replicated step counter. Weights take the bytes.
std::vector<TensorSpec> model(const DemoFlags& f) {
  const uint64_t per_weight = (f.state_mib << 20) / (2 * f.layers);
  const int64_t cols = 1024;
  const int64_t rows = std::max<int64_t>(1, static_cast<int64_t>(per_weight / 4 / cols));
  std::vector<TensorSpec> v;
  for (uint32_t l = 0; l < f.layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    v.push_back({p + "attn.weight", DType::f32, {rows, cols}, Split::rows});
    v.push_back({p + "mlp.weight", DType::f32, {cols, rows}, Split::cols});
    v.push_back({p + "norm.bias", DType::f32, {cols}, Split::replicated});
  }
  v.push_back({"optimizer.step", DType::i32, {}, Split::replicated});
  return v;
}

uint32_t mix32(uint64_t x) {
  x = (x ^ (x >> 33)) * 0xff51afd7ed558ccdull;
  x = (x ^ (x >> 33)) * 0xc4ceb9fe1a85ec53ull;
  return static_cast<uint32_t>(x ^ (x >> 33));
}

// Tensor t is rewritten ("optimizer step") at the end of every step s with
// s % 4 == t % 4; a checkpoint at step s holds the versions before step s's
// update.
uint64_t version_at(size_t t, uint32_t step) {
  uint64_t v = 0;
  for (uint32_t s = 1; s < step; ++s) v += (s % 4 == t % 4);
  return v;
}

struct Piece {
  std::vector<uint32_t> words;  // every dtype here is 4 bytes wide
  std::vector<int64_t> shape, offsets;
};

Piece piece_of(const TensorSpec& s, Split split, int rank, int world) {
  Piece p;
  p.shape = s.shape;
  p.offsets.assign(s.shape.size(), 0);
  const int dim = split == Split::rows ? 0 : split == Split::cols ? 1 : -1;
  if (dim >= 0) {
    const int64_t n = s.shape[dim];
    const int64_t b = n * rank / world, e = n * (rank + 1) / world;  // uneven when n % world
    p.offsets[dim] = b;
    p.shape[dim] = e - b;
  }
  int64_t n = 1;
  for (int64_t d : p.shape) n *= d;
  p.words.resize(static_cast<size_t>(n));
  return p;
}

// Adds each host piece to `sd` as its shard of the spec's tensor; false (the
// error printed) if the state dict refuses one.
bool add_host_pieces(const std::vector<TensorSpec>& specs, std::vector<Piece>& pieces,
                     StateDict& sd) {
  for (size_t t = 0; t < specs.size(); ++t) {
    const Status added =
        sd.add(specs[t].key, TensorView(pieces[t].words.data(), specs[t].dtype, pieces[t].shape),
               Shard{specs[t].shape, pieces[t].offsets});
    if (!added.ok()) {
      std::fprintf(stderr, "ferry demo: %s\n", added.to_string().c_str());
      return false;
    }
  }
  return true;
}

uint64_t seed_of(size_t t, uint64_t version) {
  return (static_cast<uint64_t>(t) << 40) ^ (version << 20);
}

// The words of piece p of tensor t at `version`, from global indices.
void fill(const TensorSpec& s, size_t t, uint64_t version, const Piece& p,
          std::vector<uint32_t>& out) {
  out.resize(p.words.size());
  const uint64_t seed = seed_of(t, version);
  if (s.shape.size() < 2) {
    for (size_t i = 0; i < out.size(); ++i) out[i] = mix32(seed + i);
    return;
  }
  const int64_t gcols = s.shape[1];
  size_t i = 0;
  for (int64_t r = 0; r < p.shape[0]; ++r) {
    const uint64_t row = static_cast<uint64_t>((p.offsets[0] + r) * gcols + p.offsets[1]);
    for (int64_t c = 0; c < p.shape[1]; ++c) out[i++] = mix32(seed + row + c);
  }
}

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

// The pool as configured: sized by use up to a cap (auto), or fixed.
std::string pool_text(const ferry::Options& o) {
  return o.pool_auto ? "auto, up to " + human_bytes(static_cast<double>(o.pool_bytes))
                     : human_bytes(static_cast<double>(o.pool_bytes));
}

std::unique_ptr<Runtime> start_runtime(const DemoFlags& f) {
  RuntimeArgs ra;
  ra.config_file = f.config_file;
  ra.settings = f.settings;
  ra.set("root", f.root);
  const auto t0 = std::chrono::steady_clock::now();
  auto rt = Runtime::from_env(ra);
  if (!rt.ok()) {
    std::fprintf(stderr, "ferry demo: %s\n", rt.status().to_string().c_str());
    return nullptr;
  }
  // Start must not grow with the pool: it is faulted in the background.
  std::printf("rank %d: runtime started in %.1f ms (pool %s)\n", (*rt)->rank(), ms_since(t0),
              pool_text((*rt)->options()).c_str());
  std::fflush(stdout);
  return std::move(rt).value();
}

// Waits for the save in flight (if any) to commit, prints its line with
// `committed(step, metrics)` or its failure (counted in *failures), and
// clears the handle for the next save.
template <class Print>
void finish_save(SaveHandle& inflight, int* failures, Print committed) {
  if (!inflight.valid()) return;
  const Status st = inflight.wait_committed();
  const SaveMetrics m = inflight.metrics();
  if (st.ok()) {
    committed(inflight.step(), m);
  } else {
    std::printf("checkpoint step %" PRIu64 " FAILED: %s\n", inflight.step(),
                st.to_string().c_str());
    ++*failures;
  }
  std::fflush(stdout);
  inflight = SaveHandle();
}

// --- one training rank ------------------------------------------------------------------

int train(const DemoFlags& f) {
  auto rt = start_runtime(f);
  if (!rt) return 1;
  const int rank = rt->rank(), world = rt->world_size();
  const auto specs = model(f);
  std::vector<Piece> pieces;
  StateDict sd;
  uint64_t local_bytes = 0;
  for (size_t t = 0; t < specs.size(); ++t) {
    pieces.push_back(piece_of(specs[t], specs[t].split, rank, world));
    fill(specs[t], t, 0, pieces[t], pieces[t].words);
    local_bytes += pieces[t].words.size() * 4;
  }
  if (!add_host_pieces(specs, pieces, sd)) return 1;
  std::printf("rank %d/%d: %zu tensors, %s local, pool %s\n", rank, world, specs.size(),
              human_bytes(local_bytes).c_str(), pool_text(rt->options()).c_str());
  std::fflush(stdout);

  SaveHandle inflight;
  int failures = 0, saves = 0;
  auto last_progress = std::chrono::steady_clock::now();
  auto poll = [&](bool block) {
    if (!inflight.valid()) return;
    if (block) (void)inflight.wait_committed();  // finish_save reads the outcome
    if (!inflight.done()) {
      if (ms_since(last_progress) > 250) {
        std::printf("  persisting step %" PRIu64 ": %s / %s\n", inflight.step(),
                    human_bytes(inflight.bytes_persisted()).c_str(),
                    human_bytes(inflight.bytes_total()).c_str());
        std::fflush(stdout);
        last_progress = std::chrono::steady_clock::now();
      }
      return;
    }
    finish_save(inflight, &failures, [&](uint64_t step, const SaveMetrics& m) {
      std::printf("checkpoint step %-4" PRIu64
                  " save_async %.3f ms | snapshot %.1f ms | "
                  "persisted %s in %.0f ms (%.2f GB/s) | commit %.1f ms\n",
                  step, m.save_async_ms, m.snapshot_ms, human_bytes(m.bytes).c_str(), m.total_ms,
                  m.persist_gbps(), m.commit_ms);
      if (rank == 0 && world > 1)
        std::printf("checkpoint step %-4" PRIu64 " slowest rank %d: files durable after %.0f ms\n",
                    step, m.slowest_rank, m.slowest_rank_ms);
    });
  };

  const auto t0 = std::chrono::steady_clock::now();
  for (uint32_t step = 1; step <= f.steps; ++step) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // forward/backward
    poll(false);
    if (step % f.every == 0) {
      if (inflight.valid()) poll(true);  // one save in flight, as the runtime does
      sd.entries().back().view.data = pieces.back().words.data();
      pieces.back().words[0] = step;  // the step counter
      inflight = rt->save_async(sd, step);
      ++saves;
      // The optimizer may not touch parameters before the snapshot is taken.
      if (Status s = inflight.wait_snapshot(); !s.ok())
        std::printf("snapshot of step %u failed: %s\n", step, s.to_string().c_str());
    }
    for (size_t t = step % 4; t + 1 < specs.size(); t += 4)
      fill(specs[t], t, version_at(t, step + 1), pieces[t], pieces[t].words);
  }
  poll(true);
  std::printf("rank %d: trained %u steps in %.1f s; %d checkpoints, %d failed\n", rank, f.steps,
              ms_since(t0) / 1000, saves, failures);
  return failures ? 1 : 0;
}

// --- one training rank on a GPU ------------------------------------------------------

#ifdef FERRY_DEMO_HAVE_CUDA
// The same model, schedule and checkpoints as train(), with the tensors in
// GPU memory: the optimizer step is a kernel on the training stream, the save
// is ordered after that stream, and the stream (not the host) waits for the
// snapshot before the next update.
int train_cuda(const DemoFlags& f) {
  int count = 0;
  if (int err = ferry_demo_device_count(&count); err != 0 || count == 0) {
    std::fprintf(stderr, "ferry demo: --device cuda: no CUDA device (%s)\n",
                 err ? ferry_demo_error(err) : "0 devices");
    return 3;
  }
  const char* lr = std::getenv("LOCAL_RANK");
  const int dev = (lr ? std::atoi(lr) : 0) % count;
  auto check = [](int err, const char* what) {
    if (err == 0) return true;
    std::fprintf(stderr, "ferry demo: %s: %s\n", what, ferry_demo_error(err));
    return false;
  };
  if (!check(ferry_demo_set_device(dev), "cudaSetDevice")) return 1;
  auto rt = start_runtime(f);
  if (!rt) return 1;
  const int rank = rt->rank(), world = rt->world_size();
  void* stream = nullptr;
  if (!check(ferry_demo_stream(&stream), "cudaStreamCreate")) return 1;
  const auto specs = model(f);
  std::vector<Piece> pieces;
  std::vector<void*> mem(specs.size(), nullptr);
  // Writes version `v` of tensor t on the training stream: the optimizer step.
  auto update = [&](size_t t, uint64_t v) {
    const Piece& p = pieces[t];
    const bool two_d = p.shape.size() >= 2;
    long long numel = 1;
    for (int64_t d : p.shape) numel *= d;
    return ferry_demo_fill(stream, static_cast<unsigned int*>(mem[t]), two_d ? p.shape[0] : 1,
                           two_d ? p.shape[1] : numel, two_d ? specs[t].shape[1] : 0,
                           two_d ? p.offsets[0] : 0, two_d ? p.offsets[1] : 0, seed_of(t, v));
  };
  StateDict sd;
  uint64_t local_bytes = 0;
  int rc = 0;
  for (size_t t = 0; t < specs.size() && rc == 0; ++t) {
    pieces.push_back(piece_of(specs[t], specs[t].split, rank, world));
    const size_t bytes = pieces[t].words.size() * 4;
    pieces[t].words = {};  // the bytes live on the GPU
    local_bytes += bytes;
    if (!check(ferry_demo_alloc(&mem[t], bytes), "cudaMalloc") ||
        !check(update(t, 0), "the fill kernel"))
      rc = 1;
    else if (Status added =
                 sd.add(specs[t].key,
                        TensorView(mem[t], specs[t].dtype, pieces[t].shape, Device::cuda(dev)),
                        Shard{specs[t].shape, pieces[t].offsets});
             !added.ok()) {
      std::fprintf(stderr, "ferry demo: %s\n", added.to_string().c_str());
      rc = 1;
    }
  }
  std::printf("rank %d/%d: %zu tensors on cuda:%d, %s local, pool %s\n", rank, world, specs.size(),
              dev, human_bytes(local_bytes).c_str(), pool_text(rt->options()).c_str());
  std::fflush(stdout);

  SaveHandle inflight;
  double blocked_ms = 0;
  int failures = 0, saves = 0;
  auto finish = [&] {
    finish_save(inflight, &failures, [&](uint64_t step, const SaveMetrics& m) {
      std::printf("checkpoint step %-4" PRIu64
                  " host blocked %.3f ms (save_async + wait_snapshot(stream)) | snapshot "
                  "%.1f ms | persisted %s in %.0f ms (%.2f GB/s)\n",
                  step, blocked_ms, m.snapshot_ms, human_bytes(m.bytes).c_str(), m.total_ms,
                  m.persist_gbps());
    });
  };
  const auto t0 = std::chrono::steady_clock::now();
  for (uint32_t step = 1; step <= f.steps && rc == 0; ++step) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // forward/backward
    // The loss read back each step: the host meets the stream here.
    if (!check(ferry_demo_sync(stream), "the training stream")) rc = 1;
    if (inflight.valid() && inflight.done()) finish();
    if (step % f.every == 0) {
      if (inflight.valid()) finish();  // one save in flight, as the runtime does
      if (!check(ferry_demo_set(stream, static_cast<unsigned int*>(mem.back()), step),
                 "the step counter"))
        rc = 1;
      const auto b0 = std::chrono::steady_clock::now();
      SaveOptions so;
      so.stream = stream;
      so.stream_device = Device::cuda(dev);
      inflight = rt->save_async(sd, step, so);
      ++saves;
      // The optimizer's kernels below wait on the GPU for the snapshot.
      if (Status s = inflight.wait_snapshot(stream, Device::cuda(dev)); !s.ok())
        std::printf("snapshot of step %u failed: %s\n", step, s.to_string().c_str());
      blocked_ms = ms_since(b0);
    }
    for (size_t t = step % 4; t + 1 < specs.size() && rc == 0; t += 4)
      if (!check(update(t, version_at(t, step + 1)), "the update kernel")) rc = 1;
  }
  finish();
  if (rc == 0 && !check(ferry_demo_sync(stream), "the training stream")) rc = 1;
  for (void* p : mem)
    if (p) ferry_demo_free(p);
  std::printf("rank %d: trained %u steps on cuda:%d in %.1f s; %d checkpoints, %d failed\n", rank,
              f.steps, dev, ms_since(t0) / 1000, saves, failures);
  return rc ? rc : failures ? 1 : 0;
}
#endif

// Exits (the code to return) unless --device cuda can run here; -1 to go on.
int check_device(const DemoFlags& f) {
  if (f.device != "cuda") return -1;
#ifndef FERRY_DEMO_HAVE_CUDA
  std::fprintf(stderr,
               "ferry demo: --device cuda: this ferry was built without the CUDA compiler "
               "(nvcc), so it has no GPU kernel to train with; rebuild where nvcc is found, or "
               "run without --device cuda\n");
  return 3;
#else
  int count = 0;
  const int err = ferry_demo_device_count(&count);
  if (err != 0 || count == 0) {
    std::fprintf(stderr,
                 "ferry demo: --device cuda: no CUDA device on this machine (%s); run without "
                 "--device cuda to train on host tensors\n",
                 err ? ferry_demo_error(err) : "0 devices");
    return 3;
  }
  return -1;
#endif
}

// --- one restoring rank -----------------------------------------------------------------

int restore(const DemoFlags& f) {
  auto rt = start_runtime(f);
  if (!rt) return 1;
  const int rank = rt->rank(), world = rt->world_size();
  const auto specs = model(f);
  // A different sharding from training: rows <-> columns, replicated as is.
  std::vector<Piece> pieces;
  StateDict sd;
  for (size_t t = 0; t < specs.size(); ++t) {
    const Split s = specs[t].split == Split::rows   ? Split::cols
                    : specs[t].split == Split::cols ? Split::rows
                                                    : Split::replicated;
    pieces.push_back(piece_of(specs[t], s, rank, world));
  }
  if (!add_host_pieces(specs, pieces, sd)) return 1;
  const auto t0 = std::chrono::steady_clock::now();
  const Result<LoadReport> report = rt->load_report(sd, f.root);
  const double ms = ms_since(t0);
  if (!report.ok()) {
    std::printf("rank %d: restore FAILED: %s\n", rank, report.status().to_string().c_str());
    return 1;
  }
  // The last checkpoint, or an earlier one where training stopped early
  // (--hosts: the partition).
  const auto step = static_cast<uint32_t>(report->step);
  if (f.hosts > 0) {
    const std::string& node = report->node;
    std::printf("rank %d on host %s: read %s from storage, %s from ranks of its host\n", rank,
                node.substr(node.find(':') + 1).c_str(),
                human_bytes(static_cast<double>(report->bytes_read)).c_str(),
                human_bytes(static_cast<double>(report->bytes_received)).c_str());
  }
  uint64_t bytes = 0, bad = 0;
  std::vector<uint32_t> expect;
  for (size_t t = 0; t + 1 < specs.size(); ++t) {
    fill(specs[t], t, version_at(t, step), pieces[t], expect);
    bytes += expect.size() * 4;
    if (expect != pieces[t].words) {
      std::printf("rank %d: tensor %s differs from what was saved\n", rank, specs[t].key.c_str());
      ++bad;
    }
  }
  if (pieces.back().words[0] != step) {
    std::printf("rank %d: optimizer.step is %u, expected %u\n", rank, pieces.back().words[0], step);
    ++bad;
  }
  std::printf("rank %d/%d: restored step %u (%s, resharded) in %.0f ms: %s\n", rank, world, step,
              human_bytes(bytes).c_str(), ms,
              bad ? "MISMATCH" : "every byte matches the saved state");
  return bad ? 1 : 0;
}

std::string self_exe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "ferry";
}

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// The newest timeline in `dir` whose name starts with `prefix` (names sort by
// step, then by time), copied to `to`; says where it went.
void keep_timeline(const std::string& dir, const std::string& prefix, const std::string& to) {
  auto fs = posix_filesystem();
  auto names = fs->list(dir);
  std::string last;
  if (names.ok())
    for (const auto& n : *names)
      if (n.rfind(prefix, 0) == 0 && n.size() > 5 && n.compare(n.size() - 5, 5, ".json") == 0 &&
          n > last)
        last = n;
  auto bytes = last.empty()
                   ? Result<std::string>(Status::not_found("no " + prefix + " timeline in " + dir))
                   : read_file(*fs, join_path(dir, last));
  Status s = bytes.ok() ? write_file_atomic(*fs, to, *bytes, false) : bytes.status();
  if (!s.ok()) {
    std::printf("ferry demo: no timeline in %s: %s\n", to.c_str(), s.to_string().c_str());
    return;
  }
  std::printf("ferry demo: timeline %s (open it in https://ui.perfetto.dev)\n", to.c_str());
}

// The emulated-hosts tool: where an install puts it beside the binary
// (<bin>/../share/ferry), else in the source tree it was built from (a build
// tree).
std::string hosts_tool() {
  const std::string exe = self_exe();
  const std::string dir = exe.substr(0, exe.rfind('/'));
  for (const std::string& p :
       {dir + "/../share/ferry/hosts.sh", std::string(FERRY_SOURCE_DIR) + "/tests/hosts/hosts.sh"})
    if (::access(p.c_str(), X_OK) == 0) return p;
  return "";
}

// What `cmd` printed, and its exit code in *rc.
std::string capture(const std::string& cmd, int* rc) {
  std::string out;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) {
    *rc = -1;
    return "cannot run " + cmd;
  }
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = ::pclose(p);
  *rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

// "0,1,...,n-1"
std::string host_list(uint32_t n) {
  std::string s;
  for (uint32_t i = 0; i < n; ++i) s += (i ? "," : "") + std::to_string(i);
  return s;
}

// Bytes host `i` sent and received on its link so far.
std::pair<uint64_t, uint64_t> link_bytes(const std::string& tool, const std::string& name,
                                         uint32_t i) {
  int rc = 0;
  const std::string out = capture(quote(tool) + " bytes " + name + " " + std::to_string(i), &rc);
  auto field = [&](const std::string& f) -> uint64_t {
    const auto at = out.find(f + "=");
    return rc == 0 && at != std::string::npos
               ? std::strtoull(out.c_str() + at + f.size() + 1, nullptr, 10)
               : 0;
  };
  return {field("sent"), field("received")};
}

// --hosts: training on f.hosts emulated hosts, their last one cut off after
// the first checkpoint, then the restore on f.restore_hosts others.
int demo_on_hosts(const DemoFlags& f, const std::string& exe, const std::string& common,
                  const std::string& train_pool, const std::string& restore_pool) {
  const std::string tool = hosts_tool();
  if (tool.empty()) {
    std::fprintf(
        stderr,
        "ferry demo --hosts: no hosts.sh in ../share/ferry beside %s nor in %s/tests/hosts\n",
        exe.c_str(), FERRY_SOURCE_DIR);
    return 2;
  }
  int rc = 0;
  const std::string why = capture(quote(tool) + " check", &rc);
  if (rc != 0) {
    std::fprintf(stderr, "ferry demo --hosts: cannot make hosts here: %s", why.c_str());
    return 2;
  }
  if (f.ranks % f.hosts != 0 || f.restore_ranks % f.restore_hosts != 0) {
    std::fprintf(stderr,
                 "ferry demo --hosts: %u ranks on %u hosts and %u restoring ranks on %u hosts: "
                 "each must be a multiple of its hosts\n",
                 f.ranks, f.hosts, f.restore_ranks, f.restore_hosts);
    return 2;
  }
  const std::string name = "demo" + std::to_string(::getpid() % 10000);
  const uint32_t n = std::max(f.hosts, f.restore_hosts);
  std::string up = capture(quote(tool) + " up " + name + " " + std::to_string(n) + " --shared " +
                               quote(f.root) + " --owner " + std::to_string(::getpid()),
                           &rc);
  if (rc != 0) {
    std::fprintf(stderr, "ferry demo --hosts: %s", up.c_str());
    return 1;
  }
  struct Down {
    std::string cmd;
    ~Down() { (void)std::system(cmd.c_str()); }
  } down{quote(tool) + " down " + name + " >/dev/null 2>&1"};
  const uint32_t cut = f.hosts - 1;
  std::printf(
      "ferry demo: %u hosts (%s-0 .. %s-%u), %u ranks each; host %u's link goes down "
      "once the first checkpoint is committed\n",
      f.hosts, name.c_str(), name.c_str(), f.hosts - 1, f.ranks / f.hosts, cut);
  std::fflush(stdout);
  // The partition, in the middle of training: after the first commit.
  std::atomic<bool> training{true};
  std::atomic<bool> partitioned{false};
  std::thread cutter([&] {
    char first[32];
    std::snprintf(first, sizeof(first), "/step-%08u", f.every);
    auto fs = posix_filesystem();
    while (training && !fs->stat(f.root + first).ok())
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (!training) return;
    int r = 0;
    (void)capture(quote(tool) + " link " + name + " " + std::to_string(cut) + " down", &r);
    partitioned = r == 0;
    std::printf("ferry demo: step %u committed: host %u's link is DOWN\n", f.every, cut);
    std::fflush(stdout);
  });
  // A short heartbeat timeout: the lost host is noticed in seconds.
  const std::string train_cmd = quote(tool) + " job " + name + " -n " +
                                std::to_string(f.ranks / f.hosts) + " --hosts " +
                                host_list(f.hosts) + " -- " + quote(exe) + " demo --role train" +
                                common + train_pool + " --set heartbeat-timeout=3s";
  const int trained = std::system(train_cmd.c_str());
  training = false;
  cutter.join();
  (void)capture(quote(tool) + " link " + name + " " + std::to_string(cut) + " up", &rc);
  if (partitioned)
    std::printf("ferry demo: training %s at the partition; host %u's link is up again\n",
                trained != 0 ? "stopped, as it must," : "finished before it noticed", cut);
  else if (trained != 0) {
    std::printf("ferry demo: training FAILED\n");
    return 1;
  }
  const uint32_t per_host = f.restore_ranks / f.restore_hosts;
  std::printf("ferry demo: restoring the last committed checkpoint on %u hosts, %u rank%s each\n",
              f.restore_hosts, per_host, per_host == 1 ? "" : "s");
  std::fflush(stdout);
  std::vector<std::pair<uint64_t, uint64_t>> before;
  for (uint32_t i = 0; i < f.restore_hosts; ++i) before.push_back(link_bytes(tool, name, i));
  const std::string restore_cmd =
      quote(tool) + " job " + name + " -n " + std::to_string(f.restore_ranks / f.restore_hosts) +
      " --hosts " + host_list(f.restore_hosts) + " -- " + quote(exe) + " demo --role restore" +
      common + restore_pool + " --hosts " + std::to_string(f.restore_hosts);
  const int restored = std::system(restore_cmd.c_str());
  for (uint32_t i = 0; i < f.restore_hosts; ++i) {
    const auto after = link_bytes(tool, name, i);
    std::printf("ferry demo: host %s-%u sent %s and received %s over its link during the restore\n",
                name.c_str(), i,
                human_bytes(static_cast<double>(after.first - before[i].first)).c_str(),
                human_bytes(static_cast<double>(after.second - before[i].second)).c_str());
  }
  if (restored != 0) {
    std::printf("ferry demo: restore FAILED\n");
    return 1;
  }
  std::printf(
      "ferry demo: OK: trained on %u hosts through a partition, restored on %u, every byte "
      "checked\n",
      f.hosts, f.restore_hosts);
  return 0;
}

// Marks a root the demo made or adopted, so that a rerun knows the
// checkpoints in it are the demo's to remove.
constexpr char kDemoMarker[] = ".ferry-demo";

// Makes `root` ready for a fresh run without touching what the demo did not
// create: a user's files stay, and a root holding checkpoints that are not
// the demo's is refused. Returns an exit code, or -1 to go on.
int prepare_demo_root(const std::string& root) {
  auto fs = posix_filesystem();
  Result<FileInfo> st = fs->stat(root);
  if (!st.ok() && st.status().code() != StatusCode::not_found) return failed("demo", st.status());
  if (st.ok() && !st->is_dir) {
    std::fprintf(stderr, "ferry demo: --root %s is not a directory\n", root.c_str());
    return 2;
  }
  if (!st.ok()) {
    if (Status s = fs->mkdirs(root); !s.ok()) return failed("demo", s);
  }
  auto names = fs->list(root);
  if (!names.ok()) return failed("demo", names.status());
  const bool ours = std::find(names->begin(), names->end(), kDemoMarker) != names->end();
  std::vector<std::string> leftovers;
  for (const auto& n : *names)
    if (Catalog::is_ferry_entry_name(n)) leftovers.push_back(n);
  if (!ours && !leftovers.empty()) {
    std::fprintf(stderr,
                 "ferry demo: %s holds checkpoints the demo did not make (%s, ...); "
                 "pick another --root\n",
                 root.c_str(), leftovers[0].c_str());
    return 2;
  }
  for (const auto& n : leftovers) {
    if (Status s = remove_all(*fs, join_path(root, n)); !s.ok()) return failed("demo", s);
  }
  if (!ours) {
    Status s = write_file_atomic(*fs, join_path(root, kDemoMarker),
                                 "checkpoints here were made by ferry demo\n", false);
    if (!s.ok()) return failed("demo", s);
  }
  return -1;
}

int run_demo(DemoFlags f) {
  if (int rc = check_device(f); rc >= 0) return rc;
#ifdef FERRY_DEMO_HAVE_CUDA
  if (f.role == "train" && f.device == "cuda") return train_cuda(f);
#endif
  if (f.role == "train") return train(f);
  if (f.role == "restore") return restore(f);

  // The driver: train with N ranks, restore with M.
  if (f.hosts > 0 && f.restore_hosts == 0) f.restore_hosts = f.hosts + 1;
  if (f.restore_ranks == 0) f.restore_ranks = f.hosts > 0 ? f.restore_hosts : f.ranks + 1;
  if (int rc = prepare_demo_root(f.root); rc >= 0) return rc;
  // Every host sees the same file system, but runs in its own directory.
  if (f.hosts > 0) f.root = std::filesystem::absolute(f.root).lexically_normal().string();
  const std::string exe = self_exe();
  std::string common = " --root " + quote(f.root) + " --state-mib " + std::to_string(f.state_mib) +
                       " --layers " + std::to_string(f.layers) + " --steps " +
                       std::to_string(f.steps) + " --every " + std::to_string(f.every);
  for (const auto& p : f.passthrough) common += " " + quote(p);
  // --trace: every save and the restore write their timelines here.
  const std::string traces = f.trace.empty() ? "" : f.trace + ".d";
  if (!traces.empty()) {
    common += " --set " + quote("trace-dir=" + traces);
    // An earlier demo's timelines would pass for this one's.
    auto fs = posix_filesystem();
    if (auto names = fs->list(traces); names.ok())
      for (const auto& n : *names)
        if (n.rfind("save-", 0) == 0 || n.rfind("load-", 0) == 0)
          (void)fs->unlink(join_path(traces, n));
  }
  std::printf(
      "ferry demo: %s model state over %u ranks (row-, column-sharded and replicated "
      "tensors), %u steps, checkpoint every %u, root %s\n",
      human_bytes(static_cast<double>(f.state_mib) * (1 << 20)).c_str(), f.ranks, f.steps, f.every,
      f.root.c_str());
  std::fflush(stdout);
  // Unless told otherwise, size each rank's pool to its share of the state
  // (an instant snapshot) and keep the restoring ranks' pools small: they
  // only read.
  bool pool_set = false;
  for (const auto& s : f.settings) pool_set = pool_set || s.key == "pool-bytes";
  const uint64_t share_mib = f.state_mib / f.ranks + f.state_mib / f.ranks / 8 + 16;
  const std::string train_pool =
      pool_set ? "" : " --set pool-bytes=" + std::to_string(share_mib) + "MiB";
  const std::string restore_pool = pool_set ? "" : " --set pool-bytes=64MiB";
  if (f.hosts > 0) return demo_on_hosts(f, exe, common, train_pool, restore_pool);
  const std::string train_cmd = quote(exe) + " launch -n " + std::to_string(f.ranks) + " -- " +
                                quote(exe) + " demo --role train" + common + train_pool;
  if (std::system(train_cmd.c_str()) != 0) {
    std::printf("ferry demo: training FAILED\n");
    return 1;
  }
  if (!traces.empty()) keep_timeline(traces, "save-", f.trace);
  std::printf("ferry demo: restoring the last checkpoint into %u ranks with another sharding\n",
              f.restore_ranks);
  std::fflush(stdout);
  const std::string restore_cmd = quote(exe) + " launch -n " + std::to_string(f.restore_ranks) +
                                  " -- " + quote(exe) + " demo --role restore" + common +
                                  restore_pool;
  if (std::system(restore_cmd.c_str()) != 0) {
    std::printf("ferry demo: restore FAILED\n");
    return 1;
  }
  if (!traces.empty()) {
    const auto dot = f.trace.rfind('.');
    const bool ext = dot != std::string::npos && f.trace.find('/', dot) == std::string::npos;
    keep_timeline(traces, "load-", (ext ? f.trace.substr(0, dot) : f.trace) + "-restore.json");
  }
  std::printf("ferry demo: OK: trained on %u ranks, restored on %u, every byte checked\n", f.ranks,
              f.restore_ranks);
  return 0;
}

}  // namespace

void add_demo_command(CLI::App& app, int* rc) {
  auto f = std::make_shared<DemoFlags>();
  auto sets = std::make_shared<std::vector<std::string>>();
  CLI::App* cmd = app.add_subcommand(
      "demo", "a training job that checkpoints in the background, and its restore");
  auto count = [cmd](const char* name, auto* out, const char* help) {
    add_count_flag(*cmd, name, out, help);
  };
  count("--ranks", &f->ranks, "training ranks (default 2)");
  count("--restore-ranks", &f->restore_ranks,
        "ranks that restore the last checkpoint (default ranks + 1)");
  count("--state-mib", &f->state_mib, "model state over all ranks, in MiB (default 1024)");
  count("--layers", &f->layers,
        "layers; each has a row-sharded, a column-sharded and a replicated tensor (default 8)");
  count("--steps", &f->steps, "training steps (default 30)");
  count("--every", &f->every, "checkpoint every N steps (default 10)");
  cmd->add_option("--root", f->root,
                  "checkpoint root (default ./ferry-demo-checkpoints); a rerun removes the "
                  "checkpoints an earlier demo left there, nothing else")
      ->type_name("DIR");
  CLI::Option* device =
      cmd->add_option("--device", f->device,
                      "host (default) or cuda: train on GPU tensors (rank r on GPU LOCAL_RANK % "
                      "count), updated by a kernel every step and snapshotted with a "
                      "stream-ordered wait; without a GPU it says so and exits with 3")
          ->check(CLI::IsMember({"host", "cuda"}).description(""))
          ->type_name("host|cuda");
  // Every --set is kept, in order: they go to every rank as given.
  add_set_flag(*cmd, sets.get(), "a [ferry] setting for every rank, e.g. --set pool-bytes=512MiB");
  CLI::Option* config_file =
      cmd->add_option("--config-file", f->config_file, "an INI file of [ferry] settings")
          ->type_name("PATH");
  cmd->add_option("--trace", f->trace,
                  "write the last checkpoint's timeline (every rank's phases, Chrome trace JSON: "
                  "open it in Perfetto) to FILE and the restore's to FILE-restore.json; every "
                  "save's stays in FILE.d/")
      ->type_name("FILE");
  count("--hosts", &f->hosts,
        "spread the ranks over N emulated hosts (root; tests/hosts/hosts.sh), cut the last "
        "host's link after the first checkpoint, then restore on --restore-hosts hosts, one "
        "rank each unless --restore-ranks says more, and print per host what it read and sent");
  count("--restore-hosts", &f->restore_hosts, "hosts of the restore with --hosts (default N + 1)");
  cmd->footer(
      "Starts --ranks ranks with ferry launch to train and checkpoint, then --restore-ranks\n"
      "ranks that restore the last checkpoint with another sharding and check every byte.");
  // The driver starts its ranks with --role train|restore.
  cmd->add_option("--role", f->role)->check(CLI::IsMember({"train", "restore"}))->group("");
  cmd->callback([rc, f, sets, device, config_file] {
    // What the ranks are started with: the same device, settings and file.
    if (device->count() > 0) f->passthrough.insert(f->passthrough.end(), {"--device", f->device});
    for (const std::string& kv : *sets) {
      const auto eq = kv.find('=');
      f->settings.push_back({kv.substr(0, eq), kv.substr(eq + 1), "--set"});
      f->passthrough.insert(f->passthrough.end(), {"--set", kv});
    }
    if (config_file->count() > 0) f->passthrough.push_back("--config-file=" + f->config_file);
    *rc = run_demo(*f);
  });
}

}  // namespace ferry::cli
