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

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "ferry_bench_s3: %s\nusage: ferry_bench_s3 --endpoint URL --bucket B [--mib N] "
               "[--part-mib N] [--threads N]\n",
               why.c_str());
  std::exit(2);
}

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
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) usage("missing value for " + flag);
    const std::string v = argv[++i];
    if (flag == "--endpoint")
      c.endpoint = v;
    else if (flag == "--bucket")
      bucket = v;
    else if (flag == "--mib")
      mib = std::strtoull(v.c_str(), nullptr, 10);
    else if (flag == "--part-mib")
      part_mib = std::strtoull(v.c_str(), nullptr, 10);
    else if (flag == "--threads")
      threads = std::atoi(v.c_str());
    else
      usage("unknown flag " + flag);
  }
  if (bucket.empty() || mib == 0 || part_mib == 0 || threads < 1)
    usage("--bucket, and positive sizes and threads, are needed");
  ferry::s3::config_from_environment(&c);
  c.connections = threads;
  auto client = ferry::s3::Client::create(c);
  if (!client.ok()) usage(client.status().to_string());
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
