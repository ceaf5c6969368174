// ferry demo: a synthetic training loop on host memory. Every step rewrites
// some tensors (the "optimizer"); every N steps it checkpoints in the
// background and keeps training as soon as the snapshot is taken. At the end
// it loads the last checkpoint into fresh tensors and checks every byte.
//
// Tensor contents are a pure function of (tensor, version), so the check
// regenerates the expected bytes instead of keeping a second copy.

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <thread>

#include "ferry/filesystem.hpp"
#include "ferry/runtime.hpp"
#include "tools/commands.hpp"

namespace ferry::cli {

namespace {

struct DemoFlags {
  uint64_t state_mib = 1024;
  uint32_t tensors = 64;
  uint32_t steps = 30;
  uint32_t every = 10;
  std::string root = "ferry-demo-checkpoints";
  std::vector<Setting> settings;
  std::string config_file;
};

void demo_usage() {
  std::printf(
      "usage: ferry demo [--state-mib N] [--tensors N] [--steps N] [--every N] [--root DIR]\n"
      "                  [--set KEY=VALUE]... [--config-file=PATH]\n"
      "  --state-mib   model state size in MiB (default 1024)\n"
      "  --tensors     number of tensors (default 64)\n"
      "  --steps       training steps (default 30)\n"
      "  --every       checkpoint every N steps (default 10)\n"
      "  --root        checkpoint root (default ./ferry-demo-checkpoints, emptied first)\n"
      "  --set         a [ferry] setting, e.g. --set pool-bytes=512MiB\n");
}

bool parse_u64(const std::string& s, uint64_t* out) {
  if (s.empty()) return false;
  char* end = nullptr;
  *out = std::strtoull(s.c_str(), &end, 10);
  return *end == '\0';
}

int parse_flags(const Args& args, DemoFlags* f) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&](uint64_t* out) {
      if (i + 1 >= args.size() || !parse_u64(args[i + 1], out) || *out == 0) {
        std::fprintf(stderr, "ferry demo: %s needs a positive number\n", a.c_str());
        return false;
      }
      ++i;
      return true;
    };
    uint64_t v = 0;
    if (a == "--help" || a == "-h") {
      demo_usage();
      return 0;
    } else if (a == "--state-mib") {
      if (!value(&f->state_mib)) return 2;
    } else if (a == "--tensors") {
      if (!value(&v)) return 2;
      f->tensors = static_cast<uint32_t>(v);
    } else if (a == "--steps") {
      if (!value(&v)) return 2;
      f->steps = static_cast<uint32_t>(v);
    } else if (a == "--every") {
      if (!value(&v)) return 2;
      f->every = static_cast<uint32_t>(v);
    } else if (a == "--root" && i + 1 < args.size()) {
      f->root = args[++i];
    } else if (a == "--set" && i + 1 < args.size()) {
      const std::string kv = args[++i];
      const auto eq = kv.find('=');
      if (eq == std::string::npos) {
        std::fprintf(stderr, "ferry demo: --set needs KEY=VALUE, got '%s'\n", kv.c_str());
        return 2;
      }
      f->settings.push_back({kv.substr(0, eq), kv.substr(eq + 1), "--set"});
    } else if (a.rfind("--config-file=", 0) == 0) {
      f->config_file = a.substr(14);
    } else {
      std::fprintf(stderr, "ferry demo: unknown flag '%s'\n", a.c_str());
      demo_usage();
      return 2;
    }
  }
  return -1;
}

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The bytes of tensor t at version v.
void fill(std::vector<uint64_t>& words, uint32_t t, uint64_t v) {
  const uint64_t seed = splitmix((static_cast<uint64_t>(t) << 32) ^ v);
  for (size_t i = 0; i < words.size(); ++i) words[i] = seed + i * 0x9e3779b97f4a7c15ull;
}

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

void report(const SaveHandle& h) {
  const SaveMetrics m = h.metrics();
  std::printf(
      "\r  checkpoint step %-6" PRIu64 " save_async %.3f ms | snapshot %.1f ms | persisted %s in "
      "%.0f ms (%.2f GB/s) | commit %.1f ms\n",
      h.step(), m.save_async_ms, m.snapshot_ms, human_bytes(m.bytes).c_str(), m.total_ms,
      m.persist_gbps(), m.commit_ms);
  std::fflush(stdout);
}

}  // namespace

int cmd_demo(const Args& args) {
  DemoFlags f;
  if (int rc = parse_flags(args, &f); rc >= 0) return rc;

  RuntimeArgs ra;
  ra.config_file = f.config_file;
  ra.settings = f.settings;
  ra.set("root", f.root);
  auto rt_or = Runtime::from_env(ra);
  if (!rt_or.ok()) {
    std::fprintf(stderr, "ferry demo: %s\n", rt_or.status().to_string().c_str());
    return 1;
  }
  auto& rt = *rt_or.value();
  remove_all(*posix_filesystem(), f.root);

  const uint64_t words_per = (f.state_mib << 20) / f.tensors / 8;
  std::printf("ferry demo: %u tensors x %s = %s state, %u steps, checkpoint every %u, pool %s, "
              "root %s\n",
              f.tensors, human_bytes(words_per * 8.0).c_str(),
              human_bytes(words_per * 8.0 * f.tensors).c_str(), f.steps, f.every,
              human_bytes(rt.options().pool_bytes).c_str(), f.root.c_str());

  std::vector<std::vector<uint64_t>> state(f.tensors, std::vector<uint64_t>(words_per));
  std::vector<uint64_t> version(f.tensors, 0);
  for (uint32_t t = 0; t < f.tensors; ++t) fill(state[t], t, 0);
  StateDict sd;
  for (uint32_t t = 0; t < f.tensors; ++t)
    sd.add("layer" + std::to_string(t / 4) + ".param" + std::to_string(t % 4),
           TensorView(state[t].data(), DType::f32, {static_cast<int64_t>(words_per * 2)}));

  SaveHandle inflight;
  std::vector<uint64_t> saved_version;
  std::vector<SaveHandle> done;
  int failures = 0;
  auto poll = [&](bool block) {
    if (!inflight.valid()) return;
    if (block) inflight.wait_committed();
    if (!inflight.done()) {
      std::printf("\r  persisting step %" PRIu64 ": %s / %s", inflight.step(),
                  human_bytes(inflight.bytes_persisted()).c_str(),
                  human_bytes(inflight.bytes_total()).c_str());
      std::fflush(stdout);
      return;
    }
    Status st = inflight.wait_committed();
    if (st.ok()) {
      report(inflight);
    } else {
      std::printf("\n  checkpoint step %" PRIu64 " FAILED: %s\n", inflight.step(),
                  st.to_string().c_str());
      ++failures;
    }
    done.push_back(inflight);
    inflight = SaveHandle();
  };

  const auto t0 = std::chrono::steady_clock::now();
  for (uint32_t step = 1; step <= f.steps; ++step) {
    // "Forward/backward": some compute time during which the save proceeds.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    poll(false);
    if (step % f.every == 0) {
      if (inflight.valid()) poll(true);  // one save at a time, as the runtime does
      inflight = rt.save_async(sd, step);
      saved_version = version;
      // The optimizer may not touch parameters before the snapshot is taken.
      if (Status s = inflight.wait_snapshot(); !s.ok())
        std::printf("  snapshot of step %u failed: %s\n", step, s.to_string().c_str());
    }
    // "Optimizer step": rewrite a quarter of the tensors.
    for (uint32_t t = step % 4; t < f.tensors; t += 4) fill(state[t], t, ++version[t]);
  }
  poll(true);
  std::printf("trained %u steps in %.1f s; %zu checkpoints, %d failed\n", f.steps,
              ms_since(t0) / 1000, done.size(), failures);
  if (saved_version.empty()) return failures ? 1 : 0;

  // Restore into fresh tensors and check every byte against what was saved.
  const std::string latest = rt.latest();
  std::vector<std::vector<uint64_t>> fresh(f.tensors, std::vector<uint64_t>(words_per));
  StateDict out;
  for (uint32_t t = 0; t < f.tensors; ++t)
    out.add(sd.entries()[t].key,
            TensorView(fresh[t].data(), DType::f32, {static_cast<int64_t>(words_per * 2)}));
  const auto tl = std::chrono::steady_clock::now();
  Status ls = rt.load(out, latest);
  const double load_ms = ms_since(tl);
  if (!ls.ok()) {
    std::printf("load of %s FAILED: %s\n", latest.c_str(), ls.to_string().c_str());
    return 1;
  }
  uint64_t bad = 0;
  std::vector<uint64_t> expect(words_per);
  for (uint32_t t = 0; t < f.tensors; ++t) {
    fill(expect, t, saved_version[t]);
    if (std::memcmp(expect.data(), fresh[t].data(), words_per * 8) != 0) ++bad;
  }
  std::printf("loaded %s in %.0f ms (%.2f GB/s): %s\n", latest.c_str(), load_ms,
              words_per * 8.0 * f.tensors / (load_ms * 1e6),
              bad ? "MISMATCH" : "every byte matches the saved state");
  if (bad) std::printf("  %" PRIu64 " tensors differ\n", bad);
  return (bad || failures) ? 1 : 0;
}

}  // namespace ferry::cli
