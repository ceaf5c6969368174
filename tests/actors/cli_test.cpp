// The `ferry` CLI as a user runs it: a real binary on a real checkpoint root.

#include <catch2/catch.hpp>

#include <sys/wait.h>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "ferry/catalog.hpp"
#include "ferry/runtime.hpp"
#include "ferry/verify.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using ferry::testing::TempDir;

namespace {

struct Run {
  int code = -1;
  std::string out;
};

Run run(const std::string& cmd) {
  Run r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  REQUIRE(p != nullptr);
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

const std::string kCli = FERRY_CLI_PATH;

// Two committed checkpoints of a small state, via the library.
std::string make_root(const TempDir& dir, std::vector<float>& a) {
  ferry::RuntimeArgs args;
  args.set("root", dir.path()).set("pool-bytes", "1MiB").set("chunk-bytes", "256KiB");
  auto rt = ferry::Runtime::create(args);
  REQUIRE(rt.ok());
  a.assign(50000, 1.5f);
  ferry::StateDict sd;
  REQUIRE(sd.add("encoder.weight", {a.data(), ferry::DType::f32, {500, 100}}).ok());
  REQUIRE((*rt)->save_async(sd, 100).wait_committed().ok());
  REQUIRE((*rt)->save_async(sd, 200).wait_committed().ok());
  return dir.path() + "/step-00000200";
}

}  // namespace

TEST_CASE("ferry ls lists committed checkpoints and marks LATEST", "[cli]") {
  TempDir dir;
  std::vector<float> a;
  make_root(dir, a);
  fs::create_directory(dir.path() + "/" + ferry::pending_dir_name(300, "j", "x"));
  auto r = run(kCli + " ls " + dir.path());
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("step-00000100"));
  CHECK_THAT(r.out, Catch::Contains("step-00000200"));
  CHECK_THAT(r.out, Catch::Contains("LATEST"));
  CHECK_THAT(r.out, !Catch::Contains("pending"));
}

TEST_CASE("ferry inspect shows tensors, chunks, files and checksums", "[cli]") {
  TempDir dir;
  std::vector<float> a;
  const std::string ckpt = make_root(dir, a);
  auto r = run(kCli + " inspect " + ckpt);
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("encoder.weight"));
  CHECK_THAT(r.out, Catch::Contains("F32 [500, 100]"));
  CHECK_THAT(r.out, Catch::Contains("rank-00000-0000.safetensors"));
  CHECK_THAT(r.out, Catch::Contains("header ok"));
  CHECK_THAT(r.out, Catch::Contains("xxh3"));

  // A flipped byte in the safetensors header is reported and fails inspect.
  const std::string data = ckpt + "/rank-00000-0000.safetensors";
  {
    std::fstream f(data, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(12);
    f.put('#');
  }
  r = run(kCli + " inspect " + ckpt);
  INFO(r.out);
  CHECK(r.code != 0);
  CHECK_THAT(r.out, Catch::Contains("corruption"));
}

TEST_CASE("ferry verify reads every byte and reports corruption", "[cli]") {
  TempDir dir;
  std::vector<float> a;
  const std::string ckpt = make_root(dir, a);
  auto r = run(kCli + " verify " + ckpt);
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("OK"));

  const std::string data = ckpt + "/rank-00000-0000.safetensors";
  {
    std::fstream f(data, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(data) - 7));
    f.put('\x7f');
  }
  r = run(kCli + " verify " + ckpt);
  INFO(r.out);
  CHECK(r.code == 1);
  CHECK_THAT(r.out, Catch::Contains("encoder.weight"));
  CHECK_THAT(r.out, Catch::Contains("CORRUPT"));
}

TEST_CASE("ferry gc removes expired pending directories only", "[cli]") {
  TempDir dir;
  auto fsys = ferry::posix_filesystem();
  const std::string old_dir = dir.path() + "/" + ferry::pending_dir_name(1, "j", "old");
  const std::string live_dir = dir.path() + "/" + ferry::pending_dir_name(2, "j", "live");
  fs::create_directory(old_dir);
  fs::create_directory(live_dir);
  REQUIRE(ferry::write_lease(*fsys, old_dir, ferry::now_unix_ms() - 1000, "j/old").ok());
  REQUIRE(ferry::write_lease(*fsys, live_dir, ferry::now_unix_ms() + 600000, "j/live").ok());
  auto r = run(kCli + " gc " + dir.path());
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK_FALSE(fs::exists(old_dir));
  CHECK(fs::exists(live_dir));
}

TEST_CASE("data files parse as safetensors with an independent checker", "[cli][safetensors]") {
  if (run("/usr/bin/python3 -c 'import json, struct'").code != 0) {
    WARN("skipped: /usr/bin/python3 is not available");
    return;
  }
  TempDir dir;
  auto r = run(kCli + " demo --ranks 2 --state-mib 8 --layers 2 --steps 4 --every 2 --root " +
               dir.path() + "/root --set pool-bytes=16MiB --set chunk-bytes=1MiB");
  INFO(r.out);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("restored on 3, every byte checked"));
  const std::string checker = std::string(FERRY_SOURCE_DIR) + "/tests/tools/check_safetensors.py";
  r = run("/usr/bin/python3 " + checker + " --align 4096 " + dir.path() +
          "/root/step-*/*.safetensors");
  INFO(r.out);
  CHECK(r.code == 0);
}

TEST_CASE("unknown commands and missing arguments are usage errors", "[cli]") {
  CHECK(run(kCli + " frobnicate").code == 2);
  CHECK(run(kCli + " ls").code == 2);
  auto r = run(kCli + " ls /nonexistent/ferry/root");
  CHECK(r.code == 1);
  CHECK_THAT(r.out, Catch::Contains("/nonexistent/ferry/root"));
}

TEST_CASE("ls --verify and latest_valid walk back past a corrupt checkpoint", "[cli][verify]") {
  TempDir dir;
  std::vector<float> a;
  const std::string newest = make_root(dir, a);
  {
    std::fstream f(newest + "/rank-00000-0000.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(5000);
    f.put('\x01');
  }
  auto r = run(kCli + " ls --verify " + dir.path());
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("CORRUPT"));
  CHECK_THAT(r.out, Catch::Contains("latest valid"));
  auto lv = ferry::latest_valid(*ferry::posix_filesystem(), dir.path());
  REQUIRE(lv.ok());
  CHECK(lv->path == dir.path() + "/step-00000100");
}
