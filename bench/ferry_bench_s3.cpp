// The S3 server's own limit, for bench/s3_compare.sh: PUTs, then GETs, of
// objects of --part-mib MiB adding up to --mib, --threads requests at a
// time, through Ferry's S3 client alone (no staging pool, no checksums,
// nothing checked): what a client that only moves bytes reaches.
//
//   ferry_bench_s3 --endpoint URL --bucket B [--mib N] [--part-mib N] [--threads N]
//
// Credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; the bucket
// must exist. The last line is one JSON object.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "s3/client.hpp"
#include "tools/flags.hpp"

namespace {

using Clock = std::chrono::steady_clock;

// Runs op(i) for i in [0, n) on `threads` threads; MiB/s of `bytes`, or -1
// after printing the first failure.
template <class Op>
double timed(int n, int threads, uint64_t bytes, Op op) {
  std::atomic<int> next{0};
  std::atomic<bool> failed{false};
  const auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      for (int i = next++; i < n && !failed; i = next++) {
        ferry::Status s = op(i, t);
        if (!s.ok() && !failed.exchange(true)) std::fprintf(stderr, "%s\n", s.to_string().c_str());
      }
    });
  for (auto& t : ts) t.join();
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  return failed ? -1 : static_cast<double>(bytes) / (1 << 20) / s;
}

}  // namespace

int main(int argc, char** argv) {
  ferry::s3::Config c;
  std::string bucket;
  uint64_t mib = 256, part_mib = 8;
  int threads = 8;
  CLI::App app("PUTs, then GETs, through Ferry's S3 client alone: the S3 server's own limit.",
               "ferry_bench_s3");
  // A flag given twice keeps its last value.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--endpoint", c.endpoint, "the S3 server")->type_name("URL");
  app.add_option("--bucket", bucket, "an existing bucket")->required()->type_name("B");
  const auto mib_bound = CLI::Range(uint64_t{1}, uint64_t{1} << 32).description("");
  ferry::cli::add_count_flag(app, "--mib", &mib, "MiB in all (default 256)")->check(mib_bound);
  ferry::cli::add_count_flag(app, "--part-mib", &part_mib, "MiB per object (default 8)")
      ->check(mib_bound);
  ferry::cli::add_count_flag(app, "--threads", &threads, "requests at a time (default 8)");
  ferry::cli::parse_or_exit(app, argc, argv);
  ferry::s3::config_from_environment(&c);
  c.connections = threads;
  auto client = ferry::s3::Client::create(c);
  if (!client.ok()) {
    std::fprintf(stderr, "ferry_bench_s3: %s\n", client.status().to_string().c_str());
    return 1;
  }
  ferry::s3::Client& s3 = *client.value();
  const size_t part = part_mib << 20;
  const int n = static_cast<int>((mib + part_mib - 1) / part_mib);
  std::string src(part, '\0');
  for (size_t i = 0; i < part; ++i) src[i] = static_cast<char>(i * 2654435761u >> 24);
  std::vector<std::string> dst(threads, std::string(part, '\0'));
  auto key = [](int i) { return "limit/" + std::to_string(i); };
  auto d = [] { return ferry::s3::Deadline::in(std::chrono::seconds(120)); };
  const uint64_t bytes = static_cast<uint64_t>(n) * part;
  const double put = timed(n, threads, bytes, [&](int i, int) {
    return s3.put(bucket, key(i), src.data(), part, {}, d());
  });
  const double get = timed(n, threads, bytes, [&](int i, int t) {
    auto got = s3.get(bucket, key(i), 0, dst[t].data(), part, d());
    return got.ok() ? ferry::Status() : got.status();
  });
  if (put < 0 || get < 0) return 1;
  std::printf(
      "{\"objects\":%d,\"part_mib\":%llu,\"threads\":%d,\"put_mib_s\":%.1f,"
      "\"get_mib_s\":%.1f}\n",
      n, static_cast<unsigned long long>(part_mib), threads, put, get);
  return 0;
}
