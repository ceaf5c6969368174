// Loads a saved state through Ferry from a cold cache and compares it, in
// the same run, with the limit it can at best reach on this machine: a plain
// sequential O_DIRECT reader (aligned preads of chunk-bytes, 32 MiB by
// default, of the same files into warm memory the size of the state, one
// thread: a reader of a real state cannot read it all into one small hot
// buffer, which on a VM the host fills from its cache faster).
//
//   ferry_bench_load [--bytes SIZE] [--tensors N] [--large N] [--reshard [--by-cols]] [--ranks N]
//                    [--page-aligned] [--pool-mib N] [--rounds N] [--dir DIR]
//                    [--set K=V]...
//
// Order: allocate and touch the state and the tensors to load into, save
// (not timed), then --rounds times (default 5): reset the targets, evict
// the data files (posix_fadvise DONTNEED, then drop_caches when root), load,
// check the bytes, evict again, raw read. The figures are the median round's
// (by ratio): on a shared machine one pair can be off by 2x either way.
// One-process runs also time, next to each load, a verified reader (see
// verified_read): the raw reads through four staging blocks, each block
// hashed and copied into the load's tensors: only the work any load that
// checks its bytes must do (a reference, not a bound: on a VM the buffers'
// place in memory moves either one's reads by 15-30%).
// The tensors loaded into sit 64 bytes past a page, as torch's CPU tensors
// do: where O_DIRECT wants more alignment of memory than that (512 bytes on
// a virtio disk, 4 on NVMe), the load reads into staging blocks and copies;
// --page-aligned shows the load reading straight into the tensors.
// --reshard loads 1 -> 2: two Runtime instances in this process, each a
// one-rank runtime loading half the rows of every tensor, at the same time;
// the figures are their aggregate (two runtimes that are not one job: each
// reads the checksum blocks at its split row itself, which with many small
// tensors is most of them). --ranks N --reshard is the same split over N
// ranks of one job, against one raw reader of the whole state: blocks two
// ranks share are read once, by one of them. --by-cols splits the columns
// instead (strided stretches, as a row-parallel layer's weight is loaded). --ranks N loads the
// whole state on each of N local ranks (processes started with `ferry launch`, found next to this
// binary's directory): replicated bytes are read once per node and passed
// between the ranks through rank 0, so the figures are the load's wall time,
// every rank's CPU time during it (user and kernel), its peak RSS and how much it grew during the
// load (rank 0 relays, and share-window bounds that), and its transport's send-queue high-water
// mark, beside its peer: the same number of plain O_DIRECT readers at once,
// each reading the whole state (what ranks that pass nothing between them
// could at best do). With --ranks each round launches the job and then
// reads raw, and the median round is the figure, as without. Targets are
// reported as PASS/MISS and never change the exit code; a load that fails
// or loads wrong bytes does.
// The last line is one JSON object.
#include <fcntl.h>
#include <linux/perf_event.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "checksum.hpp"
#include "cpus.hpp"
#include "ferry/runtime.hpp"
#include "tools/flags.hpp"

namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kAlign = 4096;
constexpr int64_t kCols = 1024;  // f32 columns: a row is 4 KiB

struct Flags {
  uint64_t bytes = 2048 * kMiB;
  uint32_t tensors = 120;
  uint32_t large = 0;  // --large: of the tensors, large ones holding half the state
  bool reshard = false;
  bool by_cols = false;       // --by-cols: --reshard splits columns, not rows
  bool page_aligned = false;  // --page-aligned: load targets on page boundaries
  int ranks = 1;              // --ranks: local processes loading the whole state
  std::string child_ckpt;     // --child: this process is one of those ranks
  int64_t child_rows = 0;     // --rows: with --child
  uint64_t pool_mib = 256;
  int rounds = 5;  // --rounds: load and raw read pairs; medians are reported
  std::string dir = "/var/tmp";
  std::vector<std::pair<std::string, std::string>> settings;
};

// A usage error CLI11 cannot see: two flags that do not go together.
[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "ferry_bench_load: %s\n", why.c_str());
  std::exit(2);
}

Flags parse(int argc, char** argv) {
  Flags f;
  CLI::App app(
      "Loads a saved state through Ferry from a cold cache, beside a plain O_DIRECT "
      "reader of the same files.",
      "ferry_bench_load");
  // A flag given twice keeps its last value.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  ferry::cli::add_size_flag(app, "--bytes", &f.bytes, "state size (default 2GiB)");
  ferry::cli::add_count_flag(app, "--tensors", &f.tensors,
                             "number of f32 tensors (default 120; try 2000)");
  ferry::cli::add_count_flag(app, "--large", &f.large,
                             "N of them large, holding half the state; the rest small (as a "
                             "model's: a few matrices, many vectors); one process only");
  app.add_flag("--reshard", f.reshard,
               "load 1 -> 2 ranks: two runtimes each load half the rows; with --ranks N, N "
               "ranks of one job each load 1/N of them");
  app.add_flag("--by-cols", f.by_cols,
               "with --reshard: split the columns instead (strided stretches)");
  app.add_flag("--page-aligned", f.page_aligned,
               "load into page-aligned tensors (default: 64 bytes past a page, like torch's "
               "CPU tensors)");
  ferry::cli::add_count_flag(app, "--ranks", &f.ranks,
                             "N local ranks (processes) each load the whole state (replicated)");
  ferry::cli::add_count_flag(app, "--pool-mib", &f.pool_mib,
                             "staging pool per runtime in MiB (default 256)")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 32).description(""));
  ferry::cli::add_count_flag(app, "--rounds", &f.rounds,
                             "load, then raw read, N times; the figures are the median round's "
                             "(default 5; with --ranks, 5 launches of the job)");
  app.add_option("--dir", f.dir,
                 "where to save (a fresh directory inside DIR, removed at the end; default "
                 "/var/tmp: a disk, not tmpfs)")
      ->type_name("DIR");
  ferry::cli::add_set_flag(app, &f.settings,
                           "any other [ferry] setting, e.g. --set direct-io=false");
  // A rank of --ranks, started by this bench itself.
  app.add_option("--child", f.child_ckpt)->group("");
  ferry::cli::add_count_flag(app, "--rows", &f.child_rows, "")->group("");
  ferry::cli::parse_or_exit(app, argc, argv);
  return f;
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "ferry_bench_load: %s\n", what.c_str());
  std::exit(1);
}

// What the kernel says this process did: bytes it read from storage
// (/proc/self/io read_bytes) and kernel CPU time of all its threads.
struct Usage {
  uint64_t disk_read = 0;
  double kernel_s = 0, user_s = 0;
  static Usage now() {
    Usage u;
    std::ifstream io("/proc/self/io");
    std::string key;
    uint64_t v = 0;
    while (io >> key >> v)
      if (key == "read_bytes:") u.disk_read = v;
    rusage ru{};
    ::getrusage(RUSAGE_SELF, &ru);
    u.kernel_s = static_cast<double>(ru.ru_stime.tv_sec) + ru.ru_stime.tv_usec / 1e6;
    u.user_s = static_cast<double>(ru.ru_utime.tv_sec) + ru.ru_utime.tv_usec / 1e6;
    return u;
  }
};

// Kernel CPU time of this process sampled at 4 kHz: a cpu-clock perf event
// per CPU that records only samples that found a thread of ours in the
// kernel, inherited by every thread started after it opened (open it
// before anything starts threads). getrusage splits CPU time by where the
// 250 Hz tick found each thread, a handful of ticks per load; this takes 16
// times as many. Both charge a thread with the interrupts that land while
// it runs, which a reader that sleeps through its I/O mostly escapes. Empty
// where perf events are not allowed (perf_event_paranoid, a container).
// It samples nothing until start(): setup touches gigabytes, and once a
// run's first round charged 0.62 s of kernel time to each of its loads
// (mean of five, 0.35 s each: more than two CPUs could give) against
// 0.03 s in the runs beside it; samples from before the rounds, reported
// late, were the one source that fits.
class KernelSampler {
 public:
  static constexpr uint64_t kPeriodNs = 250000;

  // `open`: false gives an empty sampler (--ranks: the ranks are other
  // processes, which would inherit it).
  explicit KernelSampler(bool open) {
    if (!open) return;
    const long cpus = ::sysconf(_SC_NPROCESSORS_ONLN);
    for (long cpu = 0; cpu < cpus; ++cpu) {
      perf_event_attr a{};
      a.size = sizeof(a);
      a.type = PERF_TYPE_SOFTWARE;
      a.config = PERF_COUNT_SW_CPU_CLOCK;
      a.sample_period = kPeriodNs;
      a.sample_type = PERF_SAMPLE_TID;
      a.exclude_user = 1;
      a.exclude_hv = 1;
      a.inherit = 1;
      a.disabled = 1;
      const int fd = static_cast<int>(::syscall(SYS_perf_event_open, &a, 0, cpu, -1, 0));
      if (fd < 0) {
        close_all();
        return;
      }
      void* p = ::mmap(nullptr, kMapBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) {
        ::close(fd);
        close_all();
        return;
      }
      rings_.push_back({fd, static_cast<perf_event_mmap_page*>(p)});
    }
  }
  ~KernelSampler() { close_all(); }
  KernelSampler(const KernelSampler&) = delete;
  KernelSampler& operator=(const KernelSampler&) = delete;

  bool ok() const { return !rings_.empty(); }
  // Starts sampling, in every thread the event reached so far too.
  void start() {
    for (Ring& r : rings_) (void)::ioctl(r.fd, PERF_EVENT_IOC_ENABLE, 0);
  }
  // Kernel seconds sampled since start(). The rings hold about
  // 15 s of samples of 2 busy CPUs: read them at least once per load.
  double seconds() {
    for (Ring& r : rings_) samples_ += r.drain();
    return static_cast<double>(samples_) * kPeriodNs / 1e9;
  }

 private:
  static constexpr size_t kDataBytes = 1 << 20;
  static constexpr size_t kMapBytes = kDataBytes + 4096;
  struct Ring {
    int fd;
    perf_event_mmap_page* page;
    uint64_t drain() {
      const uint64_t head = __atomic_load_n(&page->data_head, __ATOMIC_ACQUIRE);
      const auto* data = reinterpret_cast<const uint8_t*>(page) + 4096;
      uint64_t n = 0;
      for (uint64_t at = page->data_tail; at < head;) {
        perf_event_header h;
        copy_out(data, at, &h, sizeof(h));
        if (h.size == 0) break;
        if (h.type == PERF_RECORD_SAMPLE) ++n;
        if (h.type == PERF_RECORD_LOST) {
          uint64_t lost[2];  // id, lost
          copy_out(data, at + sizeof(h), lost, sizeof(lost));
          n += lost[1];
        }
        at += h.size;
      }
      __atomic_store_n(&page->data_tail, head, __ATOMIC_RELEASE);
      return n;
    }
    static void copy_out(const uint8_t* data, uint64_t at, void* out, size_t len) {
      for (size_t i = 0; i < len; ++i) static_cast<uint8_t*>(out)[i] = data[(at + i) % kDataBytes];
    }
  };
  void close_all() {
    for (Ring& r : rings_) {
      ::munmap(r.page, kMapBytes);
      ::close(r.fd);
    }
    rings_.clear();
  }
  std::vector<Ring> rings_;
  uint64_t samples_ = 0;
};

// Kernel CPU seconds of the live threads by name (/proc/self/task/*/stat,
// clock-tick resolution): where a load's kernel time goes. Threads that ended
// in between show up only in the process total.
std::map<std::string, double> kernel_by_thread() {
  std::map<std::string, double> out;
  const double tick = static_cast<double>(::sysconf(_SC_CLK_TCK));
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task", ec)) {
    std::ifstream cf(e.path() / "comm"), sf(e.path() / "stat");
    std::string comm, stat;
    std::getline(cf, comm);
    std::getline(sf, stat);
    // Fields after the ")" that closes the name: state is field 3, stime 15.
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    std::string field;
    for (int i = 3; i <= 15 && rest >> field; ++i)
      if (i == 15) out[comm] += std::stod(field) / tick;
  }
  return out;
}

std::string kernel_split(const std::map<std::string, double>& before,
                         const std::map<std::string, double>& after, double total) {
  std::string s;
  double named = 0;
  char buf[96];
  for (const auto& [name, t] : after) {
    auto it = before.find(name);
    const double d = t - (it == before.end() ? 0 : it->second);
    if (d <= 0) continue;
    named += d;
    std::snprintf(buf, sizeof(buf), "%s%s %.2f s", s.empty() ? "" : ", ", name.c_str(), d);
    s += buf;
  }
  std::snprintf(buf, sizeof(buf), "%sthreads that ended %.2f s", s.empty() ? "" : ", ",
                std::max(0.0, total - named));
  return s + buf;
}

// VmHWM: peak resident memory so far, in MiB (the same as ru_maxrss, but
// read the same way before and after a load to get its growth).
double vm_hwm_mib() {
  std::ifstream st("/proc/self/status");
  std::string line;
  while (std::getline(st, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  return 0;
}

double peak_rss_mib() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;
}

std::vector<std::string> data_files(const std::string& ckpt) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(ckpt))
    if (e.path().extension() == ".safetensors") out.push_back(e.path().string());
  return out;
}

// Drops the files from the page cache; drop_caches too when allowed (root).
bool evict(const std::vector<std::string>& files) {
  for (const auto& p : files) {
    const int fd = ::open(p.c_str(), O_RDONLY);
    if (fd < 0) die("cannot open " + p + ": " + std::strerror(errno));
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
  ::sync();
  std::ofstream dc("/proc/sys/vm/drop_caches");
  if (!dc) return false;
  dc << "3\n";
  dc.flush();
  return static_cast<bool>(dc);
}

// Warm (touched) page-aligned memory: what the raw reader reads into, and
// what holds each tensor a load fills. The raw reader's is in huge pages, as
// Ferry's staging pool is: in 4 KiB pages scattered by earlier runs (a
// `ferry launch` job that just freed gigabytes), each of its one-at-a-time
// 8 MiB reads became thousands of DMA segments, and the same reader took
// 0.47-0.52 s on a fresh machine but 0.89-0.98 s right after a two-rank
// bench: the machine's limit would depend on what ran before.
struct WarmMemory {
  uint8_t* data = nullptr;
  uint64_t bytes = 0;
  explicit WarmMemory(uint64_t n, bool huge = false) : bytes(n) {
    constexpr size_t kHuge = 2u << 20;
    void* mem = nullptr;
    if (::posix_memalign(&mem, huge ? kHuge : kAlign, bytes) != 0)
      die("no memory for " + std::to_string(n));
    data = static_cast<uint8_t*>(mem);
    if (huge) (void)::madvise(data, bytes, MADV_HUGEPAGE);  // a hint; refusal is fine
    std::memset(data, 0, bytes);
  }
  ~WarmMemory() { std::free(data); }
  WarmMemory(const WarmMemory&) = delete;
  WarmMemory& operator=(const WarmMemory&) = delete;
};

// The reference: each file read front to back with one O_DIRECT pread of
// `block` bytes at a time, one block after the other into `dst` (which
// holds a block more than the bytes per file).
uint64_t raw_read(const std::vector<std::string>& files, WarmMemory& dst, uint64_t block) {
  uint64_t total = 0, at = 0;
  for (const auto& p : files) {
    const int fd = ::open(p.c_str(), O_RDONLY | O_DIRECT);
    if (fd < 0) die("raw reader: cannot open " + p + " with O_DIRECT: " + std::strerror(errno));
    for (uint64_t off = 0;; off += block) {
      const ssize_t n = ::pread(fd, dst.data + at % dst.bytes, block, static_cast<off_t>(off));
      at += block;
      if (n < 0) die("raw reader: pread " + p + ": " + std::strerror(errno));
      total += static_cast<uint64_t>(n);
      if (static_cast<uint64_t>(n) < block) break;
    }
    ::close(fd);
  }
  return total;
}

// The raw read beside `busy` threads that only compute (no memory, no
// system calls): how much this machine's disk needs idle CPUs. On the test
// VM (Firecracker, whose disk emulation runs on the host beside the vCPUs)
// one busy thread of two cost the reader nothing and two cost it 45%, even
// at nice 19: a load that hashes and copies on both CPUs cannot read at the
// raw reader's speed there, whatever it does with the disk.
double raw_read_beside_busy(const std::vector<std::string>& files, WarmMemory& dst, uint64_t block,
                            unsigned busy) {
  std::atomic<bool> stop{false};
  std::vector<std::thread> spinners;
  for (unsigned i = 0; i < busy; ++i)
    spinners.emplace_back([&stop] {
      uint64_t x = 1;
      while (!stop.load(std::memory_order_relaxed))
        for (int k = 0; k < 4096; ++k) x = x * 6364136223846793005ull + 1442695040888963407ull;
      asm volatile("" : : "r"(x));
    });
  const auto t0 = Clock::now();
  raw_read(files, dst, block);
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  stop = true;
  for (auto& t : spinners) t.join();
  return s;
}

// Only the work any load that checks every byte must do here, with the load's
// own targets: the raw reader's preads, on a thread of their own, into a
// ring of kVerifiedRing staging blocks in huge pages (allocated once, as
// Ferry's pool is), while this thread sums each landed block with Ferry's
// fused loop (xxh3 per checksum block of the runtime's size, copied as it
// is summed) into the targets, filled in order whatever the bytes are (a
// load resets them). No plan, no actors, no manifest: the load's time over this one is what
// Ferry adds, where both read into memory the machine fills equally fast
// (on the test VM one buffer filled 15-30% slower than another, steadily
// within a process); this one's over the raw read is what checking and
// placing the bytes cost.
constexpr uint32_t kVerifiedRing = 4;
double verified_read(const std::vector<std::string>& files, uint64_t block, uint64_t sum_block,
                     WarmMemory& ring, const std::vector<std::pair<uint8_t*, uint64_t>>& into) {
  if (ring.bytes < block * kVerifiedRing) die("verified reader: ring too small");
  struct Read {
    int fd;
    uint64_t offset;
  };
  std::vector<int> fds;
  std::vector<Read> reads;
  for (const auto& p : files) {
    const int fd = ::open(p.c_str(), O_RDONLY | O_DIRECT);
    if (fd < 0)
      die("verified reader: cannot open " + p + " with O_DIRECT: " + std::strerror(errno));
    fds.push_back(fd);
    const uint64_t size = std::filesystem::file_size(p);
    for (uint64_t off = 0; off < size; off += block) reads.push_back({fd, off});
  }
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int64_t> got(reads.size(), -1);  // bytes each read returned
  size_t copied = 0;
  const auto t0 = Clock::now();
  std::thread disk([&] {
    for (size_t i = 0; i < reads.size(); ++i) {
      {
        std::unique_lock<std::mutex> l(mu);
        cv.wait(l, [&] { return i < copied + kVerifiedRing; });
      }
      const ssize_t n = ::pread(reads[i].fd, ring.data + i % kVerifiedRing * block, block,
                                static_cast<off_t>(reads[i].offset));
      if (n < 0) die(std::string("verified reader: pread: ") + std::strerror(errno));
      std::lock_guard<std::mutex> l(mu);
      got[i] = n;
      cv.notify_all();
    }
  });
  uint64_t sums = 0;
  size_t target = 0;
  uint64_t at = 0;  // bytes of into[target] filled
  for (size_t i = 0; i < reads.size(); ++i) {
    uint64_t n;
    {
      std::unique_lock<std::mutex> l(mu);
      cv.wait(l, [&] { return got[i] >= 0; });
      n = static_cast<uint64_t>(got[i]);
    }
    const uint8_t* src = ring.data + i % kVerifiedRing * block;
    for (uint64_t off = 0; off < n;) {
      uint64_t k = std::min(sum_block, n - off);
      if (target < into.size()) {
        k = std::min(k, into[target].second - at);
        sums += ferry::xxh3_64_copy(into[target].first + at, src + off, k);
        if ((at += k) == into[target].second) ++target, at = 0;
      } else {
        sums += ferry::xxh3_64(src + off, k);  // more file than targets: the header's bytes
      }
      off += k;
    }
    std::lock_guard<std::mutex> l(mu);
    ++copied;
    cv.notify_all();
  }
  disk.join();
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  for (int fd : fds) ::close(fd);
  asm volatile("" : : "r"(sums));
  return s;
}

// What raw_read needs of `dst` for `files` of `file_bytes` in all: a block
// more per file (each file's last read is a whole block), in whole blocks.
uint64_t raw_memory_bytes(uint64_t file_bytes, size_t files, uint64_t block) {
  return (file_bytes + files * block + block - 1) / block * block;
}

struct Tensor {
  std::vector<float> data;
  int64_t rows = 0;
};

// A tensor to load into, at a chosen alignment: by default 64 bytes past a
// page, where torch's CPU allocator leaves its tensors; with --page-aligned
// on a page, which O_DIRECT can read into straight.
struct Target {
  WarmMemory mem;
  float* data;
  Target(size_t n, bool page_aligned)
      : mem(n * sizeof(float) + kAlign),
        data(reinterpret_cast<float*>(mem.data + (page_aligned ? 0 : 64))) {
    std::fill(data, data + n, -1.0f);  // as a training job's parameters are
  }
};

// What O_DIRECT asks of memory for `path` (statx STATX_DIOALIGN), 0 if unknown.
uint32_t direct_memory_align(const std::string& path) {
#ifdef STATX_DIOALIGN
  struct statx sx {};
  if (::statx(AT_FDCWD, path.c_str(), 0, STATX_DIOALIGN, &sx) == 0 &&
      (sx.stx_mask & STATX_DIOALIGN))
    return sx.stx_dio_mem_align;
#endif
  return 0;
}

// One load and the raw read beside it (before or after, by turns).
struct Round {
  double load_s = 0, raw_s = 0, load_gbps = 0, raw_gbps = 0, ratio = 0;
  double verified_s = 0;  // verified_read's (one-process runs only)
  double load_kernel = 0, raw_kernel = 0;
  double load_cpu = 0;                       // user + kernel
  double load_sampled = 0, raw_sampled = 0;  // KernelSampler's
  uint64_t load_disk = 0, raw_disk = 0;
  std::map<std::string, double> threads0, threads1;
};

const Round& median_round(const std::vector<Round>& rounds) {
  std::vector<const Round*> by(rounds.size());
  for (size_t i = 0; i < rounds.size(); ++i) by[i] = &rounds[i];
  std::sort(by.begin(), by.end(),
            [](const Round* a, const Round* b) { return a->ratio < b->ratio; });
  return *by[by.size() / 2];
}

const char* verdict(bool ok) {
  return ok ? "PASS" : "MISS";
}

float expected_value(size_t i, uint32_t t) {
  return static_cast<float>((i * 2654435761u + t) % 1000003);
}

// What rank `r` of `world` loads of every [rows, kCols] tensor: all of it,
// or under --reshard its stretch of the rows (--by-cols: of the columns).
struct Stretch {
  int64_t row0 = 0, rows = 0, col0 = 0, cols = kCols;
};

Stretch stretch_of(const Flags& f, int64_t rows, int64_t r, int64_t world) {
  Stretch s{0, rows, 0, kCols};
  if (!f.reshard) return s;
  if (f.by_cols) {
    s.col0 = kCols * r / world;
    s.cols = kCols * (r + 1) / world - s.col0;
  } else {
    s.row0 = rows * r / world;
    s.rows = rows * (r + 1) / world - s.row0;
  }
  return s;
}

const char* split_name(const Flags& f) {
  return f.by_cols ? "columns" : "rows";
}

// One rank of --ranks: loads the whole state (with --reshard, its stretch
// of every tensor's rows) into touched tensors, checks every value, prints
// one RANKSTATS line.
int child_main(const Flags& f) {
  ferry::RuntimeArgs args;
  args.set("pool-bytes", std::to_string(f.pool_mib) + "MiB");
  for (const auto& [k, v] : f.settings) args.set(k, v);
  auto rt = ferry::Runtime::from_env(args);
  if (!rt.ok()) die("runtime: " + rt.status().to_string());
  const Stretch s = stretch_of(f, f.child_rows, (*rt)->rank(), (*rt)->world_size());
  const ferry::Shard shard{{f.child_rows, kCols}, {s.row0, s.col0}};
  std::vector<std::vector<float>> out(f.tensors);
  ferry::StateDict sd;
  for (uint32_t t = 0; t < f.tensors; ++t) {
    out[t].assign(static_cast<size_t>(s.rows * s.cols), -1.0f);
    if (!sd.add("layer." + std::to_string(t), {out[t].data(), ferry::DType::f32, {s.rows, s.cols}},
                shard)
             .ok())
      die("state dict");
  }
  // A collective load of one tensor first: every rank has filled its
  // targets and reached its peers before the timed load starts, so a rank's
  // time is the load's, not its peers' setup (load is collective). The pool
  // is left as a restart finds it: its pages fault as the load's reads use
  // them, while the background thread faults the rest.
  {
    std::vector<float> one(static_cast<size_t>(s.rows * s.cols));
    ferry::StateDict first;
    if (!first.add("layer.0", {one.data(), ferry::DType::f32, {s.rows, s.cols}}, shard).ok())
      die("state dict");
    auto warm = (*rt)->load_report(first, f.child_ckpt);
    if (!warm.ok()) die("warm-up load: " + warm.status().to_string());
  }
  const double hwm0 = vm_hwm_mib();
  const Usage u0 = Usage::now();
  const auto t0 = Clock::now();
  auto report = (*rt)->load_report(sd, f.child_ckpt);
  const double load_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const Usage u1 = Usage::now();
  const double hwm1 = vm_hwm_mib();
  if (!report.ok()) die("load: " + report.status().to_string());
  for (uint32_t t = 0; t < f.tensors; ++t)
    for (int64_t a = 0; a < s.rows; ++a)
      for (int64_t b = 0; b < s.cols; ++b)
        if (out[t][static_cast<size_t>(a * s.cols + b)] !=
            expected_value(static_cast<size_t>((s.row0 + a) * kCols + s.col0 + b), t))
          die("tensor layer." + std::to_string(t) + " loaded wrong bytes");
  std::printf(
      "RANKSTATS load_s=%.4f cpu_s=%.3f kernel_s=%.3f peak_rss_mib=%.0f hwm_growth_mib=%.0f "
      "queue_peak_mib=%.1f "
      "read_mib=%.1f received_mib=%.1f relayed_frames=%llu in_memory_mib=%.1f\n",
      load_s, u1.user_s + u1.kernel_s - u0.user_s - u0.kernel_s, u1.kernel_s - u0.kernel_s, hwm1,
      hwm1 - hwm0, report->send_queue_peak / double(kMiB), report->bytes_read / double(kMiB),
      report->bytes_received / double(kMiB),
      static_cast<unsigned long long>(report->share_frames_relayed),
      report->shared_in_memory / double(kMiB));
  return 0;
}

double field(const std::string& line, const std::string& name) {
  const auto at = line.find(name + "=");
  return at == std::string::npos ? -1 : std::stod(line.substr(at + name.size() + 1));
}

// --ranks: N local processes load the checkpoint, each the whole state, or
// with --reshard each its stretch of rows (one job of N ranks: blocks that
// two ranks' stretches share are read once, by one of them).
int ranks_main(const Flags& f, const std::string& ckpt, int64_t rows, uint64_t state_bytes,
               const std::vector<std::string>& files, uint64_t file_bytes, uint64_t block) {
  char self[4096] = {};
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) die("cannot find this program (/proc/self/exe)");
  const std::string exe(self, static_cast<size_t>(n));
  const std::string cli =
      std::filesystem::path(exe).parent_path().parent_path().string() + "/ferry";
  std::string cmd = cli + " launch -n " + std::to_string(f.ranks) + " -- " + exe + " --child " +
                    ckpt + " --rows " + std::to_string(rows) + " --tensors " +
                    std::to_string(f.tensors) + " --pool-mib " + std::to_string(f.pool_mib) +
                    (f.reshard ? " --reshard" : "") + (f.by_cols ? " --by-cols" : "");
  for (const auto& [k, v] : f.settings) cmd += " --set " + k + "=" + v;
  // The peer: replicated, what the ranks could at best do reading the whole
  // state each (no bytes passed between them), N plain O_DIRECT readers at
  // once; resharded, one such reader of the whole state (the disk's limit
  // for one copy, which the ranks share between them).
  const int peers = f.reshard ? 1 : f.ranks;
  std::vector<std::unique_ptr<WarmMemory>> dst;
  for (int r = 0; r < peers; ++r)
    dst.push_back(
        std::make_unique<WarmMemory>(raw_memory_bytes(file_bytes, files.size(), block), true));
  // Each round launches the job and reads raw one right after the other;
  // the median round (by ratio) is the figure. Which goes first alternates:
  // this VM's disk drifts over seconds, and a fixed order leans one way (a
  // raw read right after a job took 0.24-0.33 s, right before one
  // 0.27-0.34 s, 3 runs of 5 rounds each).
  struct JobRound {
    std::map<int, std::string> stats;  // each rank's RANKSTATS
    double load_s = 0, read_mib = 0;   // the slowest rank's time; what all the ranks read
    double each_s = 0, wall_s = 0;
    uint64_t disk_read = 0;
    bool dropped = false;
  };
  std::vector<JobRound> rounds(static_cast<size_t>(std::max(1, f.rounds)));
  for (size_t i = 0; i < rounds.size(); ++i) {
    JobRound& rd = rounds[i];
    auto read_raw = [&] {
      evict(files);
      const auto t1 = Clock::now();
      std::vector<std::thread> readers;
      for (int r = 0; r < peers; ++r)
        readers.emplace_back([&, r] { raw_read(files, *dst[r], block); });
      for (auto& th : readers) th.join();
      rd.each_s = std::chrono::duration<double>(Clock::now() - t1).count();
    };
    if (i % 2 == 1) read_raw();
    rd.dropped = evict(files);
    const Usage u0 = Usage::now();
    const auto t0 = Clock::now();
    FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
    if (!p) die("cannot start " + cli);
    std::string out;
    char buf[4096];
    while (std::fgets(buf, sizeof(buf), p)) out += buf;
    const int rc = ::pclose(p);
    rd.wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
    rd.disk_read = Usage::now().disk_read - u0.disk_read;
    std::istringstream lines(out);
    for (std::string line; std::getline(lines, line);) {
      const auto at = line.find("] RANKSTATS ");
      if (line.rfind("[rank ", 0) == 0 && at != std::string::npos)
        rd.stats[std::stoi(line.substr(6))] = line.substr(at + 2);
    }
    if (rc != 0 || static_cast<int>(rd.stats.size()) != f.ranks) die("ranks failed:\n" + out);
    for (const auto& [r, l] : rd.stats) {
      rd.load_s = std::max(rd.load_s, field(l, "load_s"));
      rd.read_mib += field(l, "read_mib");
    }
    if (i % 2 == 0) read_raw();
  }
  std::vector<const JobRound*> by;
  for (const JobRound& rd : rounds) by.push_back(&rd);
  std::sort(by.begin(), by.end(), [](const JobRound* a, const JobRound* b) {
    return a->each_s / a->load_s < b->each_s / b->load_s;
  });
  const JobRound& mid = *by[by.size() / 2];
  const std::map<int, std::string>& stats = mid.stats;
  const std::string& r0 = stats.at(0);
  const double load_s = mid.load_s, read_mib = mid.read_mib, each_s = mid.each_s;
  const double wall_s = mid.wall_s;
  const bool dropped = mid.dropped;
  std::string each;
  for (const JobRound& rd : rounds) {
    char one[128];
    std::snprintf(one, sizeof(one), "%s%.3f/%.3f s = %.2f", each.empty() ? "" : ", ", rd.load_s,
                  rd.each_s, rd.each_s / rd.load_s);
    each += one;
  }
  std::printf("state: %.1f MiB in %u tensors of [%lld, %lld] f32, loaded %s by %d ranks\n",
              state_bytes / double(kMiB), f.tensors, static_cast<long long>(rows),
              static_cast<long long>(kCols),
              f.reshard ? (std::string("split by ") + split_name(f)).c_str() : "whole", f.ranks);
  std::printf("cache: evicted with posix_fadvise DONTNEED%s\n",
              dropped ? " and drop_caches" : " (drop_caches not allowed: not root?)");
  std::printf("rounds (load/raw s = raw / load): %s; the median round's:\n", each.c_str());
  for (const auto& [r, l] : stats) std::printf("rank %d: %s\n", r, l.c_str());
  if (f.reshard) {
    const double ratio = each_s / load_s;
    std::printf(
        "load (%d ranks, resharded by %s): %.3f s (slowest rank), %.2f GB/s aggregate; the "
        "ranks' runtimes read %.1f MiB (one copy: %.1f MiB), the kernel saw %.1f MiB read\n",
        f.ranks, split_name(f), load_s, state_bytes / load_s / 1e9, read_mib,
        state_bytes / double(kMiB), mid.disk_read / double(kMiB));
    std::printf("raw: one O_DIRECT reader of the whole state: %.3f s, %.2f GB/s\n", each_s,
                state_bytes / each_s / 1e9);
    std::printf("\ntargets:\n  %s aggregate load / raw >= 0.85 (issue 12)  (%.3f)\n",
                verdict(ratio >= 0.85), ratio);
    std::printf(
        "{\"bench\":\"load\",\"state_bytes\":%llu,\"tensors\":%u,\"ranks\":%d,"
        "\"replicated\":false,\"reshard\":true,\"split\":\"%s\",\"load_s\":%.4f,\"raw_s\":%.4f,"
        "\"ratio\":%.3f,\"ratio_target\":0.85,\"ranks_read_bytes\":%.0f,\"disk_read_bytes\":%llu,"
        "\"rounds\":%zu,\"drop_caches\":%s}\n",
        static_cast<unsigned long long>(state_bytes), f.tensors, f.ranks, split_name(f), load_s,
        each_s, ratio, read_mib * kMiB, static_cast<unsigned long long>(mid.disk_read),
        rounds.size(), dropped ? "true" : "false");
    return 0;
  }
  std::printf(
      "load (%d ranks, replicated): %.3f s (slowest rank), %.2f GB/s delivered to all "
      "ranks; %.1f MiB read from disk by the ranks (one copy: %.1f MiB); launch wall "
      "%.1f s\n",
      f.ranks, load_s, state_bytes * double(f.ranks) / load_s / 1e9, mid.disk_read / double(kMiB),
      state_bytes / double(kMiB), wall_s);
  std::printf(
      "peer: %d raw O_DIRECT readers at once, each the whole state: %.3f s; their time / the "
      "load's: %.2f (above 1: reading once and passing bytes on beats reading them %d times)\n",
      f.ranks, each_s, each_s / load_s, f.ranks);
  // Frames of shared bytes and acks rank 0 passed on between other ranks:
  // 0 when the ranks reach each other over direct lanes (the setting direct-lanes).
  const double relayed = std::max(0.0, field(r0, "relayed_frames"));
  std::printf(
      "rank 0: peak RSS %.0f MiB, grew %.0f MiB during the load, send queue peak %.1f "
      "MiB, relayed %.0f share frames\n",
      field(r0, "peak_rss_mib"), field(r0, "hwm_growth_mib"), field(r0, "queue_peak_mib"), relayed);
  std::printf(
      "{\"bench\":\"load\",\"state_bytes\":%llu,\"tensors\":%u,\"ranks\":%d,\"replicated\":true,"
      "\"load_s\":%.4f,\"raw_each_s\":%.4f,\"raw_each_over_load\":%.3f,\"rank0_peak_rss_mib\":%.0f,"
      "\"rank0_hwm_growth_mib\":%.0f,"
      "\"rank0_queue_peak_mib\":%.1f,\"rank0_relayed_frames\":%.0f,\"rounds\":%zu,"
      "\"drop_caches\":%s}\n",
      static_cast<unsigned long long>(state_bytes), f.tensors, f.ranks, load_s, each_s,
      each_s / load_s, field(r0, "peak_rss_mib"), field(r0, "hwm_growth_mib"),
      field(r0, "queue_peak_mib"), relayed, rounds.size(), dropped ? "true" : "false");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Flags f = parse(argc, argv);
  if (!f.child_ckpt.empty()) return child_main(f);
  if (f.by_cols && !f.reshard) usage("--by-cols goes with --reshard");
  if (f.large >= f.tensors) usage("--large must be fewer than --tensors");
  if (f.large && f.ranks > 1) usage("--large goes with one process (no --ranks)");
  KernelSampler sampler(f.ranks == 1);  // before the runtimes start their threads
  const int64_t rows =
      std::max<int64_t>(2, static_cast<int64_t>(f.bytes / f.tensors / (kCols * sizeof(float))));
  // With --large, the first `large` tensors share half the bytes and the
  // others the rest: a model's few big matrices and its many small vectors.
  auto rows_of = [&](uint32_t t) {
    if (!f.large) return rows;
    const uint64_t half = f.bytes / 2, row = kCols * sizeof(float);
    const uint64_t n = t < f.large ? f.large : f.tensors - f.large;
    return std::max<int64_t>(2, static_cast<int64_t>(half / n / row));
  };
  uint64_t state_bytes = 0;
  for (uint32_t t = 0; t < f.tensors; ++t)
    state_bytes += static_cast<uint64_t>(rows_of(t)) * kCols * sizeof(float);

  std::string tmpl = f.dir + "/ferry-bench-load-XXXXXX";
  if (!mkdtemp(tmpl.data())) die("cannot create a directory in " + f.dir);
  const std::string root = tmpl;
  struct Cleanup {
    std::string p;
    ~Cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(p, ec);
    }
  } cleanup{root};

  // The state, and the tensors a load fills (touched, as a training job's
  // parameters are, so page faults are not what is measured).
  std::vector<Tensor> state(f.tensors);
  std::vector<std::unique_ptr<Target>> out;
  for (uint32_t t = 0; t < f.tensors; ++t) {
    state[t].rows = rows_of(t);
    state[t].data.resize(static_cast<size_t>(state[t].rows * kCols));
    for (size_t i = 0; i < state[t].data.size(); ++i) state[t].data[i] = expected_value(i, t);
    if (f.ranks > 1) continue;
    out.push_back(std::make_unique<Target>(state[t].data.size(), f.page_aligned));
  }

  auto make = [&]() {
    ferry::RuntimeArgs args;
    args.set("root", root).set("pool-bytes", std::to_string(f.pool_mib) + "MiB");
    for (const auto& [k, v] : f.settings) args.set(k, v);
    auto rt = ferry::Runtime::create(args);
    if (!rt.ok()) die("runtime: " + rt.status().to_string());
    return std::move(rt).value();
  };
  auto rt = make();
  // --reshard's second rank starts now: its pool is faulted in (in the
  // background) while the save runs, not during the timed load.
  std::unique_ptr<ferry::Runtime> second = f.reshard ? make() : nullptr;
  std::string ckpt;
  {
    ferry::StateDict sd;
    for (uint32_t t = 0; t < f.tensors; ++t)
      if (!sd.add("layer." + std::to_string(t),
                  {state[t].data.data(), ferry::DType::f32, {state[t].rows, kCols}})
               .ok())
        die("state dict");
    auto h = rt->save_async(sd, 1);
    const ferry::Status st = h.wait_committed();
    if (!st.ok()) die("save: " + st.to_string());
    ckpt = h.path();
  }
  const auto files = data_files(ckpt);
  uint64_t file_bytes = 0;
  for (const auto& p : files) file_bytes += std::filesystem::file_size(p);
  if (f.ranks > 1) {
    // The ranks hold the state now; this process need not.
    const uint64_t block = rt->options().chunk_bytes;
    rt.reset();
    std::vector<Tensor>().swap(state);
    return ranks_main(f, ckpt, rows, state_bytes, files, file_bytes, block);
  }

  // Ranks: one runtime loading everything, or two each loading half the rows.
  const int ranks = f.reshard ? 2 : 1;
  std::vector<std::unique_ptr<ferry::Runtime>> rts;
  rts.push_back(std::move(rt));
  if (f.reshard) rts.push_back(std::move(second));
  std::vector<ferry::StateDict> sds(ranks);
  for (int r = 0; r < ranks; ++r) {
    // Stretches of one target each: the columns' are strided views of it.
    for (uint32_t t = 0; t < f.tensors; ++t) {
      const int64_t rows_t = state[t].rows;
      const Stretch s = stretch_of(f, rows_t, r, ranks);
      ferry::TensorView v{out[t]->data + s.row0 * kCols + s.col0,
                          ferry::DType::f32,
                          {s.rows, s.cols},
                          ferry::Device::host(),
                          {kCols, 1}};
      const ferry::Status st = f.reshard
                                   ? sds[r].add("layer." + std::to_string(t), v,
                                                ferry::Shard{{rows_t, kCols}, {s.row0, s.col0}})
                                   : sds[r].add("layer." + std::to_string(t), v);
      if (!st.ok()) die("state dict: " + st.to_string());
    }
  }

  const uint64_t block = rts[0]->options().chunk_bytes;
  WarmMemory raw_dst(raw_memory_bytes(file_bytes, files.size(), block), true);
  WarmMemory ring(block * kVerifiedRing, true);
  std::vector<std::pair<uint8_t*, uint64_t>> spans;  // the load's targets, for verified_read
  for (uint32_t t = 0; t < f.tensors; ++t)
    spans.push_back({reinterpret_cast<uint8_t*>(out[t]->data), state[t].data.size() * 4});
  // Each round loads and reads raw (and verified) one right after the
  // other: they see the same state of the machine, and the median round is
  // the figure, not one lucky run. Which goes first alternates (see
  // ranks_main); the verified read is always next to the load.
  std::vector<Round> rounds(static_cast<size_t>(f.rounds));
  bool dropped = true;
  uint64_t raw_bytes = 0;
  sampler.start();
  for (size_t i = 0; i < rounds.size(); ++i) {
    Round& rd = rounds[i];
    auto read_raw = [&] {
      evict(files);
      const double k2 = sampler.seconds();
      const Usage u2 = Usage::now();
      const auto t1 = Clock::now();
      raw_bytes = raw_read(files, raw_dst, block);
      rd.raw_s = std::chrono::duration<double>(Clock::now() - t1).count();
      const Usage u3 = Usage::now();
      rd.raw_sampled = sampler.seconds() - k2;
      rd.raw_kernel = u3.kernel_s - u2.kernel_s;
      rd.raw_disk = u3.disk_read - u2.disk_read;
    };
    auto read_verified = [&] {
      evict(files);
      rd.verified_s =
          verified_read(files, block, rts[0]->options().checksum_block_bytes, ring, spans);
    };
    if (i % 2 == 1) read_raw(), read_verified();
    // Targets hold the wrong bytes again, or a load that wrote nothing in a
    // later round would pass the byte check.
    for (uint32_t t = 0; t < f.tensors; ++t)
      std::fill(out[t]->data, out[t]->data + state[t].data.size(), -1.0f);
    dropped = evict(files) && dropped;
    rd.threads0 = kernel_by_thread();
    const double k0 = sampler.seconds();
    const Usage u0 = Usage::now();
    const auto t0 = Clock::now();
    std::vector<ferry::Status> results(ranks);
    {
      std::vector<std::thread> threads;
      for (int r = 0; r < ranks; ++r)
        threads.emplace_back([&, r] { results[r] = rts[r]->load(sds[r], ckpt); });
      for (auto& th : threads) th.join();
    }
    rd.load_s = std::chrono::duration<double>(Clock::now() - t0).count();
    const Usage u1 = Usage::now();
    const double k1 = sampler.seconds();
    rd.threads1 = kernel_by_thread();
    for (int r = 0; r < ranks; ++r)
      if (!results[r].ok()) die("load (rank " + std::to_string(r) + "): " + results[r].to_string());
    for (uint32_t t = 0; t < f.tensors; ++t)
      if (std::memcmp(out[t]->data, state[t].data.data(), state[t].data.size() * 4) != 0)
        die("tensor layer." + std::to_string(t) + " loaded wrong bytes");
    if (i % 2 == 0) read_verified(), read_raw();
    rd.load_sampled = k1 - k0;
    rd.load_gbps = static_cast<double>(state_bytes) / rd.load_s / 1e9;
    rd.raw_gbps = static_cast<double>(raw_bytes) / rd.raw_s / 1e9;
    rd.ratio = rd.load_gbps / rd.raw_gbps;
    rd.load_kernel = u1.kernel_s - u0.kernel_s;
    rd.load_cpu = u1.kernel_s + u1.user_s - u0.kernel_s - u0.user_s;
    rd.load_disk = u1.disk_read - u0.disk_read;
  }
  // The disk beside one busy thread, then beside one per CPU, each after an
  // eviction; raw_read alone is the rounds' figure.
  const unsigned cpus = ferry::usable_cpus();  // as the loader counts them
  evict(files);
  const double busy_one_s = raw_read_beside_busy(files, raw_dst, block, 1);
  evict(files);
  const double busy_all_s = raw_read_beside_busy(files, raw_dst, block, cpus);
  const Round& mid = median_round(rounds);
  const double load_s = mid.load_s, load_gbps = mid.load_gbps, raw_s = mid.raw_s,
               raw_gbps = mid.raw_gbps, ratio = mid.ratio;
  // Kernel time comes from getrusage, which splits a thread's CPU time by
  // where the clock tick found it (250 Hz here): a load's 15-20 ms are a
  // handful of ticks, so one round's ratio swings 1.3-4.6x. The mean over
  // the rounds counts all their ticks.
  double load_kernel = 0, raw_kernel = 0, load_sampled = 0, raw_sampled = 0, load_cpu = 0;
  for (const Round& rd : rounds) {
    load_cpu += rd.load_cpu / rounds.size();
    load_kernel += rd.load_kernel / rounds.size();
    raw_kernel += rd.raw_kernel / rounds.size();
    load_sampled += rd.load_sampled / rounds.size();
    raw_sampled += rd.raw_sampled / rounds.size();
  }
  const double kernel_ratio = raw_kernel > 0 ? load_kernel / raw_kernel : 0;
  const double sampled_ratio = raw_sampled > 0 ? load_sampled / raw_sampled : 0;
  const uint64_t load_disk = mid.load_disk, raw_disk = mid.raw_disk;
  const double target = f.reshard ? 0.85 : 0.9;
  const double rss = peak_rss_mib();

  std::printf("state: %.1f MiB in %u tensors of [%lld, %lld] f32, %zu data file(s) of %.1f MiB\n",
              state_bytes / double(kMiB), f.tensors, static_cast<long long>(rows_of(f.tensors - 1)),
              static_cast<long long>(kCols), files.size(), file_bytes / double(kMiB));
  if (f.large)
    std::printf("       of them %u large ones of [%lld, %lld] holding half of it\n", f.large,
                static_cast<long long>(rows_of(0)), static_cast<long long>(kCols));
  std::printf("cache: evicted with posix_fadvise DONTNEED%s\n",
              dropped ? " and drop_caches" : " (drop_caches not allowed: not root?)");
  const uint32_t dio_mem = direct_memory_align(files.front());
  std::printf(
      "load targets: %s; O_DIRECT here wants memory aligned to %u bytes, so large tensors are "
      "%s\n",
      f.page_aligned ? "page-aligned" : "64 bytes past a page (like torch's CPU tensors)", dio_mem,
      dio_mem && (f.page_aligned ? kAlign : 64) % dio_mem == 0
          ? "read straight into"
          : "read into staging blocks and copied (--page-aligned to read straight into them)");
  std::string each;
  for (const Round& rd : rounds) {
    char one[128];
    std::snprintf(one, sizeof(one), "%s%.3f/%.3f/%.3f s = %.2f", each.empty() ? "" : ", ",
                  rd.load_s, rd.verified_s, rd.raw_s, rd.ratio);
    each += one;
  }
  std::printf("rounds (load/verified/raw s = load / raw): %s\n", each.c_str());
  std::printf("median round of %zu:\n", rounds.size());
  std::printf("load (%s): %.3f s, %.2f GB/s, %.1f MiB read from disk, kernel CPU %.2f s\n",
              f.reshard ? (std::string("1 -> 2 ranks by ") + split_name(f) + ", aggregate").c_str()
                        : "same sharding",
              load_s, load_gbps, load_disk / double(kMiB), mid.load_kernel);
  std::printf("load kernel CPU by thread: %s\n",
              kernel_split(mid.threads0, mid.threads1, mid.load_kernel).c_str());
  std::printf(
      "raw O_DIRECT reader: %.3f s, %.2f GB/s, %.1f MiB read from disk, kernel CPU %.2f s\n", raw_s,
      raw_gbps, raw_disk / double(kMiB), mid.raw_kernel);
  std::printf("load / raw: %.2f (target >= %.2f: %s)\n", ratio, target, verdict(ratio >= target));
  std::printf(
      "verified reader (the raw reads through %u staging blocks, each summed and copied into the "
      "load's tensors by one thread: only the work a load that checks its bytes must do): %.3f "
      "s; load / verified %.2f, verified / raw %.2f\n",
      kVerifiedRing, mid.verified_s, mid.verified_s / load_s, raw_s / mid.verified_s);
  std::printf(
      "kernel CPU load / raw, mean of the rounds, getrusage (250 Hz ticks): %.2f (%.3f s / %.3f "
      "s; target <= 2: %s)\n",
      kernel_ratio, load_kernel, raw_kernel, verdict(kernel_ratio <= 2.0));
  if (sampler.ok())
    std::printf(
        "kernel CPU load / raw, mean of the rounds, sampled at 4 kHz: %.2f (%.3f s / %.3f s; "
        "target <= 2: %s)\n",
        sampled_ratio, load_sampled, raw_sampled, verdict(sampled_ratio <= 2.0));
  else
    std::printf("kernel CPU sampled at 4 kHz: perf events not allowed here\n");
  std::printf(
      "load CPU (user + kernel), mean of the rounds: %.3f s per load, %.2f of %u CPUs busy on "
      "average\n",
      load_cpu, load_cpu / load_s, cpus);
  std::printf(
      "disk beside busy CPUs (threads that only compute): raw reader beside 1 busy thread %.3f s "
      "(%.2fx the median round's raw speed), beside %u %.3f s (%.2fx)\n",
      busy_one_s, raw_s / busy_one_s, cpus, busy_all_s, raw_s / busy_all_s);
  std::printf(
      "peak RSS: %.0f MiB (state, load targets and the raw reader's memory %.0f MiB, pool %llu "
      "MiB x %d)\n",
      rss, (2 * state_bytes + raw_dst.bytes) / double(kMiB),
      static_cast<unsigned long long>(f.pool_mib), ranks);
  std::printf(
      "{\"bench\":\"load\",\"state_bytes\":%llu,\"tensors\":%u,\"large\":%u,\"ranks\":%d,"
      "\"reshard\":%s,"
      "\"split\":\"%s\",\"page_aligned\":%s,\"rounds\":%zu,"
      "\"load_s\":%.4f,\"load_gbps\":%.3f,\"raw_s\":%.4f,\"raw_gbps\":%.3f,\"ratio\":%.3f,"
      "\"verified_s\":%.4f,\"ratio_target\":%.2f,"
      "\"load_disk_read_bytes\":%llu,\"raw_disk_read_bytes\":%llu,"
      "\"load_kernel_s\":%.3f,\"raw_kernel_s\":%.3f,\"kernel_ratio\":%.2f,"
      "\"load_kernel_sampled_s\":%.4f,\"raw_kernel_sampled_s\":%.4f,\"kernel_ratio_sampled\":%.2f,"
      "\"load_cpu_s\":%.3f,\"raw_busy_one_s\":%.4f,\"raw_busy_all_s\":%.4f,\"cpus\":%u,"
      "\"peak_rss_mib\":%.0f,\"drop_caches\":%s}\n",
      static_cast<unsigned long long>(state_bytes), f.tensors, f.large, ranks,
      f.reshard ? "true" : "false", f.reshard ? split_name(f) : "none",
      f.page_aligned ? "true" : "false", rounds.size(), load_s, load_gbps, raw_s, raw_gbps, ratio,
      mid.verified_s, target, static_cast<unsigned long long>(load_disk),
      static_cast<unsigned long long>(raw_disk), load_kernel, raw_kernel, kernel_ratio,
      sampler.ok() ? load_sampled : -1.0, sampler.ok() ? raw_sampled : -1.0,
      sampler.ok() ? sampled_ratio : -1.0, load_cpu, busy_one_s, busy_all_s, cpus, rss,
      dropped ? "true" : "false");
  return 0;
}
