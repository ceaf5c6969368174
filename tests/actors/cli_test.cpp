// The `ferry` CLI as a user runs it: a real binary on a real checkpoint root.

#include <catch2/catch.hpp>

#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "catalog.hpp"
#include "drills/fault_fs.hpp"
#include "ferry/runtime.hpp"
#include "layout.hpp"
#include "manifest.hpp"
#include "process.hpp"
#include "test_util.hpp"
#include "verify.hpp"

namespace fs = std::filesystem;
using ferry::testing::run_shell;
using ferry::testing::TempDir;

namespace {

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
  auto fsys = ferry::posix_filesystem();
  const std::string live = dir.path() + "/" + ferry::pending_dir_name(300, "j", "live");
  const std::string old = dir.path() + "/" + ferry::pending_dir_name(250, "j", "old");
  fs::create_directory(live);
  fs::create_directory(old);
  REQUIRE(ferry::write_lease(*fsys, live, ferry::now_unix_ms() + 600000, "j/live").ok());
  REQUIRE(ferry::write_lease(*fsys, old, ferry::now_unix_ms() - 5000, "j/old").ok());
  auto r = run_shell(kCli + " ls " + dir.path());
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("step-00000100"));
  CHECK_THAT(r.out, Catch::Contains("step-00000200"));
  CHECK_THAT(r.out, Catch::Contains("LATEST"));
  // Pending saves are shown as such, with their lease, never as checkpoints.
  CHECK_THAT(r.out, Catch::Contains("pending .pending-00000300-j-live  lease live for"));
  CHECK_THAT(r.out, Catch::Contains("owner j/live"));
  CHECK_THAT(r.out, Catch::Contains("pending .pending-00000250-j-old  lease expired"));
  CHECK_THAT(r.out, Catch::Contains("owner j/old (gc takes it)"));
}

TEST_CASE("ferry --help lists every command, CMD --help prints that command's help", "[cli]") {
  auto r = run_shell(kCli + " --help");
  INFO(r.out);
  CHECK(r.code == 0);
  for (const char* cmd : {"ls", "inspect", "verify", "gc", "config", "kill-points", "power-cut",
                          "demo", "launch", "export"}) {
    INFO(cmd);
    CHECK_THAT(r.out, Catch::Contains(std::string("\n  ") + cmd + " "));
    auto h = run_shell(kCli + " " + cmd + " --help");
    INFO(h.out);
    CHECK(h.code == 0);
    CHECK_THAT(h.out, Catch::Contains(std::string("usage: ferry ") + cmd));
    CHECK_THAT(h.out, !Catch::Contains("--help:"));  // never taken for a path
  }
  auto i = run_shell(kCli + " inspect -h");
  CHECK(i.code == 0);
  CHECK_THAT(i.out, Catch::Contains("usage: ferry inspect"));
}

TEST_CASE("ferry verify and inspect accept a root, meaning its latest", "[cli]") {
  TempDir dir;
  std::vector<float> a;
  const std::string newest = make_root(dir, a);
  auto v = run_shell(kCli + " verify " + dir.path());
  INFO(v.out);
  CHECK(v.code == 0);
  CHECK_THAT(v.out, Catch::Contains("OK"));
  CHECK_THAT(v.out, Catch::Contains(newest));
  auto i = run_shell(kCli + " inspect " + dir.path());
  INFO(i.out);
  CHECK(i.code == 0);
  CHECK_THAT(i.out, Catch::Contains("checkpoint " + newest));
  CHECK_THAT(i.out, Catch::Contains("encoder.weight"));
  TempDir empty;
  auto none = run_shell(kCli + " verify " + empty.path());
  CHECK(none.code == 1);
  CHECK_THAT(none.out, Catch::Contains("no committed checkpoint"));
}

TEST_CASE("ferry ls, inspect and verify never block on a FIFO", "[cli][fifo]") {
  TempDir dir;
  std::vector<float> a;
  make_root(dir, a);
  const std::string bad = dir.path() + "/step-00000300";
  fs::create_directory(bad);
  REQUIRE(mkfifo((bad + "/MANIFEST").c_str(), 0644) == 0);
  auto r = run_shell(kCli + " ls " + dir.path());
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("not a regular file"));
  r = run_shell(kCli + " inspect " + bad);
  CHECK(r.code == 1);
  CHECK_THAT(r.out, Catch::Contains(bad + "/MANIFEST"));
  r = run_shell(kCli + " verify " + bad);
  CHECK(r.code == 1);
}

TEST_CASE("ferry demo --root deletes only what the demo created", "[cli][demo]") {
  TempDir dir;
  const std::string root = dir.path() + "/root";
  fs::create_directory(root);
  std::ofstream(root + "/notes.txt") << "mine";
  const std::string flags =
      " --ranks 2 --restore-ranks 1 --state-mib 4 --layers 1 --steps 2 --every 2"
      " --set pool-bytes=8MiB --set chunk-bytes=1MiB --root " +
      root;
  for (int pass = 0; pass < 2; ++pass) {  // the second run removes the first's checkpoints
    auto r = run_shell(kCli + " demo" + flags);
    INFO(r.out);
    REQUIRE(r.code == 0);
    CHECK(fs::exists(root + "/notes.txt"));
    CHECK(fs::exists(root + "/step-00000002"));
  }
  // Checkpoints the demo did not make are refused, not deleted.
  const std::string other = dir.path() + "/other";
  fs::create_directories(other + "/step-00000001");
  auto r = run_shell(kCli + " demo" + flags.substr(0, flags.find(" --root")) + " --root " + other);
  INFO(r.out);
  CHECK(r.code == 2);
  CHECK_THAT(r.out, Catch::Contains("did not make"));
  CHECK(fs::exists(other + "/step-00000001"));
}

TEST_CASE("ferry inspect shows tensors, chunks, files and checksums", "[cli]") {
  TempDir dir;
  std::vector<float> a;
  const std::string ckpt = make_root(dir, a);
  auto r = run_shell(kCli + " inspect " + ckpt);
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
  r = run_shell(kCli + " inspect " + ckpt);
  INFO(r.out);
  CHECK(r.code != 0);
  CHECK_THAT(r.out, Catch::Contains("corruption"));
}

TEST_CASE("ferry verify reads every byte and reports corruption", "[cli]") {
  TempDir dir;
  std::vector<float> a;
  const std::string ckpt = make_root(dir, a);
  auto r = run_shell(kCli + " verify " + ckpt);
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("OK"));

  const std::string data = ckpt + "/rank-00000-0000.safetensors";
  {
    std::fstream f(data, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(data) - 7));
    f.put('\x7f');
  }
  r = run_shell(kCli + " verify " + ckpt);
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
  auto r = run_shell(kCli + " gc " + dir.path());
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK_FALSE(fs::exists(old_dir));
  CHECK(fs::exists(live_dir));
}

TEST_CASE("data files parse as safetensors with an independent checker", "[cli][safetensors]") {
  if (run_shell("/usr/bin/python3 -c 'import json, struct'").code != 0) {
    FERRY_SKIP("/usr/bin/python3 is not available to run the independent checker");
  }
  TempDir dir;
  auto r = run_shell(kCli + " demo --ranks 2 --state-mib 8 --layers 2 --steps 4 --every 2 --root " +
                     dir.path() + "/root --set pool-bytes=16MiB --set chunk-bytes=1MiB");
  INFO(r.out);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("restored on 3, every byte checked"));
  const std::string checker = std::string(FERRY_SOURCE_DIR) + "/tests/tools/check_safetensors.py";
  r = run_shell("/usr/bin/python3 " + checker + " --align 4096 " + dir.path() +
                "/root/step-*/*.safetensors");
  INFO(r.out);
  CHECK(r.code == 0);
}

TEST_CASE("unknown commands and missing arguments are usage errors", "[cli]") {
  CHECK(run_shell(kCli + " frobnicate").code == 2);
  CHECK(run_shell(kCli + " ls").code == 2);
  auto r = run_shell(kCli + " ls /nonexistent/ferry/root");
  CHECK(r.code == 1);
  CHECK_THAT(r.out, Catch::Contains("/nonexistent/ferry/root"));
}

TEST_CASE("every command's help lists its flags, and the top help lists the commands", "[cli]") {
  auto top = run_shell(kCli + " --help");
  REQUIRE(top.code == 0);
  CHECK_THAT(top.out, Catch::Contains("usage: ferry"));
  // No arguments: the same list, on stderr, as a usage error.
  auto none = run_shell(kCli + " 2>&1 >/dev/null");
  CHECK(none.code == 2);
  for (const char* cmd : {"ls", "inspect", "export", "demo", "launch"}) {
    CHECK_THAT(top.out, Catch::Contains(std::string("\n  ") + cmd + " "));
    CHECK_THAT(none.out, Catch::Contains(std::string("\n  ") + cmd + " "));
  }
  const std::map<std::string, std::vector<std::string>> flags = {
      {"ls", {"ROOT", "--verify"}},
      {"inspect", {"CKPT"}},
      {"export", {"CKPT", "OUT", "--max-shard-bytes SIZE", "--block-bytes SIZE"}},
      {"launch", {"-n,--nproc N", "--port P", "--grace S", "CMD"}},
      {"demo",
       {"--ranks N", "--restore-ranks N", "--state-mib N", "--layers N", "--steps N", "--every N",
        "--root DIR", "--device", "--set KEY=VALUE", "--config-file PATH", "--trace FILE",
        "--hosts N", "--restore-hosts N"}},
  };
  for (const auto& [cmd, names] : flags) {
    auto h = run_shell(kCli + " " + cmd + " --help");
    INFO(h.out);
    CHECK(h.code == 0);
    for (const auto& name : names) CHECK_THAT(h.out, Catch::Contains(name));
  }
  // The ranks' own flag is the driver's business.
  CHECK_THAT(run_shell(kCli + " demo --help").out, !Catch::Contains("--role"));
}

TEST_CASE("an unknown flag or a bad value is a usage error that names it", "[cli]") {
  struct Case {
    std::string args;
    std::vector<std::string> says;
  };
  const Case cases[] = {
      {"ls --frob /tmp", {"ferry ls", "--frob"}},
      {"verify /a /b", {"ferry verify", "/b"}},
      {"config extra", {"ferry config", "extra"}},
      {"export /a /b --block-bytes 12parsecs",
       {"ferry export", "--block-bytes", "'12parsecs' is not a size", "expected a size like"}},
      {"export /a /b --max-shard-bytes 1.5GiB", {"--max-shard-bytes", "'1.5GiB' is not a size"}},
      {"export /a /b --max-shard-bytes 0", {"--max-shard-bytes", "must be positive"}},
      {"export /a /b --block-bytes", {"--block-bytes"}},
      {"export /a", {"ferry export", "OUT"}},
      {"launch -n 0 -- true", {"ferry launch", "--nproc"}},
      {"launch -n 2", {"ferry launch", "CMD"}},
      {"launch -- true", {"ferry launch", "--nproc"}},
      {"launch -n 1 --port 70000 -- true", {"--port"}},
      {"launch -n 1 --grace nan -- true", {"--grace", "'nan'"}},
      {"launch -n 1 --frob -- true", {"ferry launch", "--frob"}},
      {"demo --ranks 0", {"ferry demo", "--ranks"}},
      {"demo --steps many", {"ferry demo", "--steps", "many"}},
      {"demo --device tpu", {"ferry demo", "--device", "tpu"}},
      {"demo --set pool-bytes", {"ferry demo", "--set", "KEY=VALUE"}},
      {"demo --frob", {"ferry demo", "--frob"}},
      {"frobnicate", {"unknown command 'frobnicate'"}},
  };
  for (const auto& c : cases) {
    auto r = run_shell(kCli + " " + c.args);
    INFO(c.args << "\n" << r.out);
    CHECK(r.code == 2);
    for (const auto& s : c.says) CHECK_THAT(r.out, Catch::Contains(s));
  }
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
  auto r = run_shell(kCli + " ls --verify " + dir.path());
  INFO(r.out);
  CHECK(r.code == 1);  // the latest checkpoint is corrupt
  CHECK_THAT(r.out, Catch::Contains("CORRUPT"));
  CHECK_THAT(r.out, Catch::Contains("latest valid"));
  auto lv = ferry::latest_valid(*ferry::posix_filesystem(), dir.path());
  REQUIRE(lv.ok());
  CHECK(lv->path == dir.path() + "/step-00000100");
}

TEST_CASE("ferry export writes whole tensors as plain safetensors with an index", "[cli][export]") {
  TempDir dir;
  const std::string root = dir.sub("root");
  std::vector<float> emb(300 * 64);
  for (size_t i = 0; i < emb.size(); ++i) emb[i] = static_cast<float>(i) * 0.5f;
  std::vector<uint16_t> bias(64);
  for (size_t i = 0; i < bias.size(); ++i) bias[i] = static_cast<uint16_t>(0x3f80 + i);
  int64_t count = 17;
  std::vector<uint8_t> mask = {1, 0, 1, 1, 0, 0, 1, 0, 1};
  float none = 0;
  {
    ferry::RuntimeArgs args;
    args.set("root", root).set("pool-bytes", "1MiB").set("chunk-bytes", "16KiB");
    auto rt = ferry::Runtime::create(args);
    REQUIRE(rt.ok());
    ferry::StateDict sd;
    REQUIRE(sd.add("emb", {emb.data(), ferry::DType::f32, {300, 64}}).ok());
    REQUIRE(sd.add("ln.bias", {bias.data(), ferry::DType::bf16, {64}}).ok());
    REQUIRE(sd.add("count", {&count, ferry::DType::i64, {}}).ok());
    REQUIRE(sd.add("mask", {mask.data(), ferry::DType::boolean, {9}}).ok());
    REQUIRE(sd.add("empty", {&none, ferry::DType::f32, {0, 4}}).ok());
    REQUIRE((*rt)->save_async(sd, 40).wait_committed().ok());
  }
  const std::map<std::string, std::pair<std::string, std::string>> want = {
      {"emb", {"F32", std::string(reinterpret_cast<char*>(emb.data()), emb.size() * 4)}},
      {"ln.bias", {"BF16", std::string(reinterpret_cast<char*>(bias.data()), bias.size() * 2)}},
      {"count", {"I64", std::string(reinterpret_cast<char*>(&count), 8)}},
      {"mask", {"BOOL", std::string(reinterpret_cast<char*>(mask.data()), mask.size())}},
      {"empty", {"F32", ""}},
  };

  // emb (75 KiB) is over both caps: a file of its own, read in row blocks.
  const std::string out = dir.sub("hf");
  auto r = run_shell(kCli + " export " + root + " " + out +
                     " --max-shard-bytes 40000 --block-bytes 10KB");
  INFO(r.out);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains(out + "/model.safetensors.index.json"));
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(out))
    if (e.path().extension() == ".safetensors") files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  REQUIRE(files.size() == 3);  // [count], [emb], [empty, ln.bias, mask]
  CHECK_THAT(files[0], Catch::EndsWith("model-00001-of-00003.safetensors"));

  std::ifstream idx(out + "/model.safetensors.index.json");
  const std::string index((std::istreambuf_iterator<char>(idx)), std::istreambuf_iterator<char>());
  uint64_t total = 0;
  std::set<std::string> seen;
  for (const auto& path : files) {
    std::ifstream f(path, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    auto h = ferry::parse_safetensors_header(bytes, bytes.size());
    REQUIRE(h.ok());
    CHECK(h->data_start % 8 == 0);
    bool has_step = false;
    for (const auto& [k, v] : h->metadata) has_step |= k == "ferry.step" && v == "40";
    CHECK(has_step);
    for (const auto& e : h->entries) {
      INFO(e.name);
      REQUIRE(want.count(e.name));
      seen.insert(e.name);
      CHECK(e.dtype == want.at(e.name).first);
      CHECK(bytes.substr(h->data_start + e.begin, e.end - e.begin) == want.at(e.name).second);
      CHECK_THAT(index, Catch::Contains("\"" + e.name + "\": \"" +
                                        fs::path(path).filename().string() + "\""));
      total += e.end - e.begin;
    }
  }
  CHECK(seen.size() == want.size());
  CHECK_THAT(index, Catch::Contains("\"total_size\": " + std::to_string(total)));
  if (run_shell("/usr/bin/python3 -c 'import json'").code == 0) {
    const std::string checker = std::string(FERRY_SOURCE_DIR) + "/tests/tools/check_safetensors.py";
    auto c = run_shell("/usr/bin/python3 " + checker + " --align 8 " + out + "/*.safetensors");
    INFO(c.out);
    CHECK(c.code == 0);
  }

  // A corrupt byte in the checkpoint fails the export naming the tensor; OUT
  // gets no index and no partial file.
  const std::string data = root + "/step-00000040/rank-00000-0000.safetensors";
  {
    std::fstream f(data, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(fs::file_size(data) - 4096));
    const char c = static_cast<char>(f.get());
    f.seekp(static_cast<std::streamoff>(fs::file_size(data) - 4096));
    f.put(static_cast<char>(c ^ 0x40));
  }
  const std::string bad = dir.sub("bad");
  r = run_shell(kCli + " export " + root + " " + bad + " --block-bytes 10000");
  INFO(r.out);
  CHECK(r.code == 1);
  CHECK_THAT(r.out, Catch::Contains("ferry export:") && Catch::Contains("emb"));
  CHECK_FALSE(fs::exists(bad + "/model.safetensors.index.json"));
  for (const auto& e : fs::directory_iterator(bad))
    CHECK(e.path().filename().string().find(".tmp") == std::string::npos);

  CHECK(run_shell(kCli + " export " + root).code == 2);
  r = run_shell(kCli + " export " + dir.sub("nothing") + " " + dir.sub("o"));
  CHECK(r.code == 1);
  CHECK_THAT(r.out, Catch::Contains(dir.sub("nothing")));
}

namespace {

// Opens and reads of one file (inotify): a file Ferry must never touch.
class Untouched {
 public:
  explicit Untouched(const std::string& path) : path_(path) {
    fd_ = ::inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    REQUIRE(fd_ >= 0);
    REQUIRE(::inotify_add_watch(fd_, path.c_str(), IN_OPEN | IN_ACCESS | IN_MODIFY) >= 0);
  }
  ~Untouched() { ::close(fd_); }
  // Events since the watch began (or the last call).
  int touches() {
    int n = 0;
    alignas(struct inotify_event) char buf[4096];
    ssize_t got;
    while ((got = ::read(fd_, buf, sizeof(buf))) > 0)
      for (char* p = buf; p < buf + got;
           p += sizeof(struct inotify_event) + reinterpret_cast<struct inotify_event*>(p)->len)
        ++n;
    return n;
  }

 private:
  std::string path_;
  int fd_ = -1;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

bool is_link(const std::string& path) {
  return fs::is_symlink(fs::symlink_status(path));
}

}  // namespace

TEST_CASE("no save, load, gc, retention or export reads or writes through a planted link",
          "[cli][symlink]") {
  TempDir dir;
  const std::string root = dir.sub("root");
  const std::string outside = dir.sub("outside");
  fs::create_directories(outside);
  const std::string victim = outside + "/victim";
  { std::ofstream(victim) << "OUTSIDE"; }
  Untouched victim_watch(victim);

  ferry::RuntimeArgs args;
  args.set("root", root)
      .set("pool-bytes", "1MiB")
      .set("chunk-bytes", "256KiB")
      .set("keep-last", "1");
  auto rt = ferry::Runtime::create(args);
  REQUIRE(rt.ok());
  std::vector<float> a(50000, 1.5f);
  ferry::StateDict sd;
  REQUIRE(sd.add("encoder.weight", {a.data(), ferry::DType::f32, {500, 100}}).ok());
  REQUIRE((*rt)->save_async(sd, 100).wait_committed().ok());

  // The root's lock file: a link there fails every save naming it.
  fs::remove(root + "/.ferry-lock");
  fs::create_symlink(victim, root + "/.ferry-lock");
  ferry::Status st = (*rt)->save_async(sd, 200).wait_committed();
  INFO(st.to_string());
  CHECK_FALSE(st.ok());
  CHECK_THAT(st.message(), Catch::Contains(".ferry-lock") && Catch::Contains("symbolic link"));
  fs::remove(root + "/.ferry-lock");

  // LATEST and the names of its temp files: replaced or refused, never
  // written through.
  fs::remove(root + "/LATEST");
  fs::create_symlink(victim, root + "/LATEST");
  for (int k = 0; k < 64; ++k)
    fs::create_symlink(
        victim, root + "/LATEST.tmp-" + std::to_string(::getpid()) + "-" + std::to_string(k));
  st = (*rt)->save_async(sd, 200).wait_committed();
  INFO(st.to_string());
  REQUIRE(st.ok());
  const std::string step = root + "/step-00000200";
  const std::string data = step + "/rank-00000-0000.safetensors";
  std::vector<float> back(50000, 0.f);
  ferry::StateDict into;
  REQUIRE(into.add("encoder.weight", {back.data(), ferry::DType::f32, {500, 100}}).ok());
  REQUIRE((*rt)->load(into, root).ok());
  CHECK(back == a);

  // A data file that is a link to the same bytes elsewhere (a manifest
  // whose checks it passes): load, verify and export refuse it, naming it,
  // and never open what it points at.
  const std::string copy = outside + "/copy.safetensors";
  fs::rename(data, copy);
  fs::create_symlink(copy, data);
  {
    Untouched copy_watch(copy);
    std::fill(back.begin(), back.end(), 0.f);
    st = (*rt)->load(into, root);
    CHECK_FALSE(st.ok());
    CHECK_THAT(st.message(), Catch::Contains(data) && Catch::Contains("symbolic link"));
    auto r = run_shell(kCli + " verify " + step);
    CHECK(r.code == 1);
    CHECK_THAT(r.out, Catch::Contains(data) && Catch::Contains("symbolic link"));
    r = run_shell(kCli + " export " + root + " " + dir.sub("out-bad"));
    CHECK(r.code == 1);
    CHECK_THAT(r.out, Catch::Contains(data));
    CHECK(copy_watch.touches() == 0);
  }
  fs::remove(data);
  fs::rename(copy, data);

  // The MANIFEST as a link: the checkpoint is unreadable, never read there.
  const std::string manifest_copy = outside + "/MANIFEST";
  fs::rename(step + "/MANIFEST", manifest_copy);
  fs::create_symlink(manifest_copy, step + "/MANIFEST");
  {
    Untouched manifest_watch(manifest_copy);
    auto r = run_shell(kCli + " ls " + root);
    CHECK_THAT(r.out, Catch::Contains("UNREADABLE") && Catch::Contains("symbolic link"));
    CHECK_FALSE((*rt)->load(into, root).ok());
    CHECK(manifest_watch.touches() == 0);
  }
  fs::remove(step + "/MANIFEST");
  fs::rename(manifest_copy, step + "/MANIFEST");

  // A step, a pending save and trash that are links to a whole checkpoint
  // elsewhere: retention never counts nor retires the step, gc removes the
  // links, and nothing there is opened or deleted.
  const std::string elsewhere = outside + "/ckpt";
  fs::copy(step, elsewhere, fs::copy_options::recursive);
  fs::create_symlink(elsewhere, root + "/step-00000050");
  fs::create_symlink(elsewhere, root + "/.pending-00000999-j-x");
  fs::create_symlink(elsewhere, root + "/.trash-1-2-3");
  {
    Untouched data_watch(elsewhere + "/rank-00000-0000.safetensors");
    Untouched manifest_watch(elsewhere + "/MANIFEST");
    REQUIRE((*rt)->save_async(sd, 300).wait_committed().ok());
    CHECK_FALSE(fs::exists(step));  // keep-last 1 retired step 200, not the link
    CHECK(is_link(root + "/step-00000050"));
    auto r = run_shell(kCli + " gc " + root);
    INFO(r.out);
    CHECK(r.code == 0);
    CHECK_FALSE(is_link(root + "/.pending-00000999-j-x"));
    CHECK_FALSE(is_link(root + "/.trash-1-2-3"));
    CHECK(data_watch.touches() == 0);
    CHECK(manifest_watch.touches() == 0);
  }
  CHECK(fs::exists(elsewhere + "/rank-00000-0000.safetensors"));

  // Export: links at its temp and final names are replaced, never written.
  const std::string out = dir.sub("out");
  fs::create_directories(out);
  for (const char* name :
       {"model-00001-of-00001.safetensors", "model-00001-of-00001.safetensors.tmp",
        "model.safetensors.index.json", "model.safetensors.index.json.tmp"})
    fs::create_symlink(victim, out + "/" + name);
  auto r = run_shell(kCli + " export " + root + " " + out);
  INFO(r.out);
  CHECK(r.code == 0);
  CHECK_FALSE(is_link(out + "/model-00001-of-00001.safetensors"));
  CHECK_FALSE(is_link(out + "/model.safetensors.index.json"));

  CHECK(victim_watch.touches() == 0);
  CHECK(slurp(victim) == "OUTSIDE");
}

TEST_CASE("ferry verify says when it could not check the bytes", "[cli][verify]") {
  TempDir dir;
  ferry::RuntimeArgs args;
  args.set("root", dir.path()).set("pool-bytes", "1MiB").set("checksum", "false");
  auto rt = ferry::Runtime::create(args);
  REQUIRE(rt.ok());
  std::vector<float> a(50000, 1.5f);
  ferry::StateDict sd;
  REQUIRE(sd.add("encoder.weight", {a.data(), ferry::DType::f32, {500, 100}}).ok());
  REQUIRE((*rt)->save_async(sd, 100).wait_committed().ok());
  const std::string ckpt = dir.path() + "/step-00000100";
  // A flipped byte nobody can see: verify must not call this OK.
  const std::string data = ckpt + "/rank-00000-0000.safetensors";
  {
    std::fstream f(data, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(data) - 7));
    f.put('\x7f');
  }
  auto r = run_shell(kCli + " verify " + ckpt);
  INFO(r.out);
  CHECK(r.code == 3);
  CHECK_THAT(r.out, Catch::Contains("UNCHECKED:") && Catch::Contains("without checksums"));
  CHECK_THAT(r.out, !Catch::Contains("OK:"));
  r = run_shell(kCli + " ls --verify " + dir.path());
  INFO(r.out);
  CHECK_THAT(r.out, Catch::Contains("bytes unchecked"));
}

namespace {

// Rewrites `ckpt`'s MANIFEST after `edit` (a new file, as a writer would).
template <class Edit>
void edit_manifest(const std::string& ckpt, Edit edit) {
  auto fsys = ferry::posix_filesystem();
  auto m = ferry::read_manifest(*fsys, ckpt);
  REQUIRE(m.ok());
  edit(*m);
  REQUIRE(
      ferry::write_file_atomic(*fsys, ckpt + "/MANIFEST", ferry::encode_manifest(*m), false).ok());
}

}  // namespace

TEST_CASE("ferry verify and export refuse a manifest whose tensors are malformed",
          "[cli][verify]") {
  TempDir dir;
  std::vector<float> a;
  const std::string ckpt = make_root(dir, a);
  SECTION("a tensor its chunks do not cover") {
    edit_manifest(ckpt, [](ferry::Manifest& m) { m.tensors[0].global_shape = {1000, 100}; });
    auto r = run_shell(kCli + " verify " + ckpt);
    INFO(r.out);
    CHECK(r.code == 1);
    CHECK_THAT(r.out, Catch::Contains("malformed manifest: tensor 'encoder.weight'") &&
                          Catch::Contains("cover 50000 of its 100000 elements"));
    CHECK_THAT(r.out, Catch::Contains("CORRUPT:"));
  }
  SECTION("a tensor of 2^64 bytes or more") {
    edit_manifest(ckpt, [](ferry::Manifest& m) {
      m.tensors[0].global_shape = {int64_t{1} << 62, int64_t{1} << 62};
    });
    auto r = run_shell(kCli + " verify " + ckpt);
    INFO(r.out);
    CHECK(r.code == 1);
    CHECK_THAT(r.out,
               Catch::Contains("tensor 'encoder.weight'") && Catch::Contains("2^64 bytes or more"));
    const std::string out = dir.sub("out");
    r = run_shell(kCli + " export " + ckpt + " " + out);
    INFO(r.out);
    CHECK(r.code == 1);
    CHECK_THAT(r.out, Catch::Contains("encoder.weight") && Catch::Contains("2^64"));
    CHECK_FALSE(fs::exists(out + "/model-00001-of-00001.safetensors"));
  }
}

TEST_CASE("verify calls a file it may not read an I/O error, not corruption", "[cli][verify]") {
  TempDir dir;
  std::vector<float> a;
  const std::string ckpt = make_root(dir, a);
  // The tests run as root, whom chmod does not stop: inject the EACCES.
  auto faulty = std::make_shared<ferry::FaultFilesystem>(ferry::posix_filesystem());
  ferry::FaultRule rule;
  rule.op = ferry::FaultOp::open;
  rule.error = EACCES;
  rule.nth = 1;
  rule.sticky = true;
  rule.path_contains = "rank-00000-0000.safetensors";
  faulty->add_rule(rule);
  auto rep = ferry::verify_checkpoint(*faulty, ckpt);
  REQUIRE(rep.ok());
  REQUIRE_FALSE(rep->problems.empty());
  for (const auto& p : rep->problems) {
    CHECK(p.code() == ferry::StatusCode::io_error);
    CHECK_THAT(p.message(), Catch::Contains("rank-00000-0000.safetensors"));
  }
  CHECK(std::string(rep->verdict()) == "UNREADABLE");
  faulty->clear_rules();
  rep = ferry::verify_checkpoint(*faulty, ckpt);
  REQUIRE(rep.ok());
  CHECK(std::string(rep->verdict()) == "OK");
}

TEST_CASE("ferry inspect escapes control characters of keys, metadata and ids", "[cli]") {
  TempDir dir;
  std::vector<float> a;
  const std::string ckpt = make_root(dir, a);
  edit_manifest(ckpt, [](ferry::Manifest& m) {
    m.tensors[0].key = "enc\x1b[2Jweight\n";
    m.job_id = "job\r\x07";
    m.metadata.push_back({"note\x1b]0;owned\x07",
                          "line\nbreak \xc2\x9b"
                          "31m \xff caf\xc3\xa9"});
  });
  auto r = run_shell(kCli + " inspect " + ckpt);
  INFO(r.out);
  CHECK(r.code == 0);
  for (char c : std::string("\x1b\x07\r")) CHECK(r.out.find(c) == std::string::npos);
  CHECK(r.out.find("\xc2\x9b") == std::string::npos);  // C1 CSI
  CHECK_THAT(r.out, Catch::Contains("enc\\x1b[2Jweight\\x0a"));
  CHECK_THAT(r.out, Catch::Contains("job job\\x0d\\x07"));
  CHECK_THAT(r.out, Catch::Contains("meta note\\x1b]0;owned\\x07 = line\\x0abreak \\xc2\\x9b31m "
                                    "\\xff caf\xc3\xa9"));

  // Names in a root are anyone's too: `ferry ls` and `ferry gc` print a
  // pending directory's name escaped.
  fs::create_directory(dir.path() + "/.pending-00000300-j-\x1b[2Jx");
  for (const char* cmd : {" ls ", " gc "}) {
    r = run_shell(kCli + cmd + dir.path());
    INFO(r.out);
    CHECK(r.out.find('\x1b') == std::string::npos);
    CHECK_THAT(r.out, Catch::Contains(".pending-00000300-j-\\x1b[2Jx"));
  }
}
