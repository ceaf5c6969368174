// Times make_global_plan (validation, grouping, owner and file assignment) on
// synthetic local plans of a transformer-like model, at 64 to 4096 ranks.
//
//   ferry_bench_plan [--ranks 64,256,1024,4096] [--items 500]
//                    [--shape mixed|sharded|both] [--reps 5]
//
// Shapes: "sharded" row-shards every tensor across all ranks (FSDP-like);
// "mixed" keeps every fifth tensor replicated on all ranks (norms, biases and
// now and then a large embedding that the balanced policy splits) and
// row-shards the rest. Plans are built before the clock starts: only the
// global planning is timed, best of --reps. The last line is one JSON object.
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "plan.hpp"
#include "tools/flags.hpp"

namespace {

struct Args {
  std::vector<int> ranks{64, 256, 1024, 4096};
  int items = 500;
  std::vector<std::string> shapes{"mixed", "sharded"};
  int reps = 5;
};

Args parse(int argc, char** argv) {
  Args a;
  CLI::App app("Times make_global_plan on synthetic local plans of a transformer-like model.",
               "ferry_bench_plan");
  // A flag given twice keeps its last value.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  // Bounds that keep the synthetic plans' memory sane.
  const auto bound = CLI::Range(1, 1 << 24).description("");
  std::vector<int> ranks;
  app.add_option("--ranks", ranks,
                 "rank counts to plan, comma-separated (default 64,256,1024,4096)")
      ->delimiter(',')
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->check(ferry::cli::positive_count())
      ->check(bound)
      ->type_name("LIST");
  ferry::cli::add_count_flag(app, "--items", &a.items, "tensors per rank (default 500)")
      ->check(bound);
  std::string shape = "both";
  app.add_option("--shape", shape, "mixed, sharded or both (default both)")
      ->check(CLI::IsMember({"mixed", "sharded", "both"}))
      ->type_name("mixed|sharded|both");
  ferry::cli::add_count_flag(app, "--reps", &a.reps, "timed plans; the best is kept (default 5)")
      ->check(bound);
  ferry::cli::parse_or_exit(app, argc, argv);
  if (!ranks.empty()) a.ranks = ranks;
  if (shape != "both") a.shapes = {shape};
  return a;
}

// Tensor i of the synthetic model: replicated or row-sharded, and its shape.
struct Tensor {
  std::string key;
  ferry::DType dtype;
  std::vector<int64_t> shape;
  bool replicated;
};

std::vector<Tensor> model(int items, int ranks, bool mixed) {
  std::vector<Tensor> ts;
  ts.reserve(items);
  for (int i = 0; i < items; ++i) {
    Tensor t;
    t.key =
        "model.layers." + std::to_string(i / 10) + ".block." + std::to_string(i % 10) + ".weight";
    t.dtype = ferry::DType::bf16;
    t.replicated = mixed && i % 5 == 0;
    if (t.replicated) {
      // Mostly small norms; every 50th a 400 MB embedding (split by default).
      t.shape = i % 50 == 0 ? std::vector<int64_t>{50304, 4096} : std::vector<int64_t>{4096};
    } else {
      // Rows not a multiple of the rank count, so some shards are uneven.
      t.shape = {static_cast<int64_t>(ranks) * 16 + (i % 7), 1024 + 128 * (i % 4)};
    }
    ts.push_back(std::move(t));
  }
  return ts;
}

std::vector<ferry::LocalPlan> build_plans(int ranks, int items, bool mixed) {
  const std::vector<Tensor> ts = model(items, ranks, mixed);
  std::vector<ferry::LocalPlan> plans(ranks);
  for (int r = 0; r < ranks; ++r) {
    auto& p = plans[r];
    p.rank = r;
    p.items.reserve(items);
    for (int i = 0; i < items; ++i) {
      const Tensor& t = ts[i];
      ferry::WriteItem w;
      w.key = t.key;
      w.dtype = t.dtype;
      w.global_shape = t.shape;
      w.entry = static_cast<uint32_t>(i);
      if (t.replicated) {
        w.box.offsets.assign(t.shape.size(), 0);
        w.box.sizes = t.shape;
      } else {
        const int64_t rows = t.shape[0], base = rows / ranks, extra = rows % ranks;
        const int64_t begin = r * base + std::min<int64_t>(r, extra);
        w.box.offsets = {begin, 0};
        w.box.sizes = {base + (r < extra ? 1 : 0), t.shape[1]};
      }
      int64_t n = 1;
      for (int64_t s : w.box.sizes) n *= s;
      w.nbytes = static_cast<uint64_t>(n) * ferry::dtype_size(t.dtype);
      p.items.push_back(std::move(w));
    }
  }
  return plans;
}

// This thread's CPU time: unlike wall time, it does not count the slices that
// other processes take on a shared machine.
double cpu_ms() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

struct Row {
  int ranks;
  int items;
  std::string shape;
  double ms;
  double cpu_ms;
  uint64_t chunks;
  uint64_t unique;
  double max_over_mean;  // the most loaded rank against the average
};

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  std::vector<Row> rows;
  std::printf("%-8s %-6s %-8s %10s %10s %10s %10s %10s %10s\n", "ranks", "items", "shape", "ms",
              "cpu_ms", "ns/item", "chunks", "groups", "max/mean");
  for (const std::string& shape : args.shapes) {
    for (int ranks : args.ranks) {
      const auto plans = build_plans(ranks, args.items, shape == "mixed");
      double best = 1e300, best_cpu = 1e300;
      ferry::GlobalPlan keep;
      for (int rep = 0; rep < args.reps; ++rep) {
        const double c0 = cpu_ms();
        const auto t0 = std::chrono::steady_clock::now();
        auto gp = ferry::make_global_plan(plans);
        const auto t1 = std::chrono::steady_clock::now();
        const double c1 = cpu_ms();
        if (!gp.ok()) {
          std::fprintf(stderr, "make_global_plan failed: %s\n", gp.status().to_string().c_str());
          return 1;
        }
        best = std::min(best, std::chrono::duration<double, std::milli>(t1 - t0).count());
        best_cpu = std::min(best_cpu, c1 - c0);
        // Freeing the previous result is kept outside the timed region.
        keep = std::move(gp).value();
      }
      Row row{ranks, args.items, shape, best, best_cpu, 0, keep.unique_items, 0};
      uint64_t max_bytes = 0;
      for (const auto& rp : keep.ranks) {
        row.chunks += rp.chunks.size();
        max_bytes = std::max(max_bytes, rp.bytes);
      }
      const double mean = static_cast<double>(keep.total_bytes) / ranks;
      row.max_over_mean = mean > 0 ? max_bytes / mean : 0;
      const double total_items = static_cast<double>(ranks) * args.items;
      std::printf("%-8d %-6d %-8s %10.2f %10.2f %10.1f %10llu %10llu %10.3f\n", ranks, args.items,
                  shape.c_str(), best, best_cpu, best * 1e6 / total_items,
                  static_cast<unsigned long long>(row.chunks),
                  static_cast<unsigned long long>(row.unique), row.max_over_mean);
      rows.push_back(row);
    }
  }
  // The target: 1024 ranks x 500 items planned in 25 ms.
  for (const Row& r : rows)
    if (r.ranks == 1024 && r.items == 500)
      std::printf("1024x500 %s: %.2f ms (cpu %.2f ms), %.2fx the 25 ms target\n", r.shape.c_str(),
                  r.ms, r.cpu_ms, r.ms / 25.0);
  std::string json = "{\"bench\":\"plan\",\"target_ms_1024x500\":25,\"results\":[";
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "%s{\"ranks\":%d,\"items_per_rank\":%d,\"shape\":\"%s\",\"ms\":%.3f,"
                  "\"cpu_ms\":%.3f,\"chunks\":%llu,\"groups\":%llu,\"max_over_mean\":%.4f}",
                  i ? "," : "", r.ranks, r.items, r.shape.c_str(), r.ms, r.cpu_ms,
                  static_cast<unsigned long long>(r.chunks),
                  static_cast<unsigned long long>(r.unique), r.max_over_mean);
    json += buf;
  }
  json += "]}";
  std::printf("%s\n", json.c_str());
  return 0;
}
