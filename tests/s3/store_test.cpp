// One conformance suite for every Store: a directory (POSIX), a directory
// behind the fault-injecting filesystem, and S3 against the suite's server.
#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>

#include "drills/fault_fs.hpp"
#include "s3/s3_store.hpp"
#include "s3_server.hpp"
#include "store.hpp"

using namespace ferry;

namespace {

std::string pattern(size_t n, uint32_t seed) {
  std::string s(n, '\0');
  uint32_t x = seed * 2654435761u + 7;
  for (auto& ch : s) {
    x = x * 1103515245u + 12345u;
    ch = static_cast<char>(x >> 24);
  }
  return s;
}

// Each kind makes a fresh, empty store, or says why it cannot here.
struct Directory {
  static std::string make(testing::TempDir& tmp, std::shared_ptr<Store>* out) {
    auto s = directory_store(posix_filesystem(), tmp.sub("root"));
    REQUIRE(s.ok());
    *out = s.value();
    return "";
  }
};

struct FaultDirectory {
  static std::string make(testing::TempDir& tmp, std::shared_ptr<Store>* out) {
    auto fs = std::make_shared<FaultFilesystem>(posix_filesystem());
    auto s = directory_store(fs, tmp.sub("root"));
    REQUIRE(s.ok());
    *out = s.value();
    return "";
  }
};

struct S3 {
  static std::string make(testing::TempDir&, std::shared_ptr<Store>* out) {
    testing::S3Server server = testing::s3_server();
    if (!server.unavailable.empty()) return server.unavailable;
    auto c = s3::Client::create(server.config);
    REQUIRE(c.ok());
    std::string bucket = testing::fresh_bucket();
    REQUIRE(c.value()->create_bucket(bucket, s3::Deadline::in(std::chrono::seconds(30))).ok());
    S3StoreOptions o;
    o.client = server.config;
    o.part_bytes = 5u << 20;
    auto s = s3_store("s3://" + bucket + "/run1", o);
    REQUIRE(s.ok());
    *out = s.value();
    return "";
  }
};

}  // namespace

#define MAKE_STORE(store)                                                  \
  testing::TempDir tmp_;                                                   \
  std::shared_ptr<Store> store;                                            \
  {                                                                        \
    std::string why_ = TestType::make(tmp_, &store);                       \
    if (!why_.empty()) {                                                   \
      if (testing::s3_required()) FAIL("FERRY_REQUIRE_S3=1 but " << why_); \
      FERRY_SKIP(why_ << " (FERRY_REQUIRE_S3=1 makes this a failure)");    \
    }                                                                      \
  }

TEMPLATE_TEST_CASE("store: an object written in pieces, out of order and from threads, reads back",
                   "[store]", Directory, FaultDirectory, S3) {
  MAKE_STORE(store);
  const uint64_t part = std::max<uint64_t>(store->part_bytes(), 1u << 20);
  const std::string data = pattern(3 * part + 4321, 1);
  auto w = store->create("step-1/data-0.bin");
  REQUIRE_OK(w);
  std::vector<std::thread> threads;
  std::atomic<int> failed{0};
  for (uint64_t off : {2 * part, 0 * part, 3 * part, 1 * part})
    threads.emplace_back([&, off] {
      size_t len = static_cast<size_t>(std::min<uint64_t>(part, data.size() - off));
      if (!w.value()->write(off, data.data() + off, len).ok()) ++failed;
    });
  for (auto& t : threads) t.join();
  REQUIRE(failed == 0);
  // Not an object until finished.
  CHECK(store->size("step-1/data-0.bin").status().code() == StatusCode::not_found);
  CHECK(store->list("step-1/").value().empty());
  REQUIRE_OK(w.value()->finish(data.size()));

  auto size = store->size("step-1/data-0.bin");
  REQUIRE_OK(size);
  CHECK(size.value() == data.size());
  std::string piece(10000, '\0');
  auto got = store->read("step-1/data-0.bin", part - 5000, piece.data(), piece.size());
  REQUIRE_OK(got);
  CHECK(got.value() == piece.size());
  CHECK(piece == data.substr(part - 5000, 10000));
  auto tail = store->read("step-1/data-0.bin", data.size() - 21, piece.data(), piece.size());
  REQUIRE_OK(tail);
  CHECK(tail.value() == 21);
  auto all = store->read_all("step-1/data-0.bin", data.size());
  REQUIRE_OK(all);
  CHECK(all.value() == data);
  auto capped = store->read_all("step-1/data-0.bin", 100);
  CHECK_FALSE(capped.ok());
}

TEMPLATE_TEST_CASE("store: small objects, listing by prefix, replace, remove", "[store]", Directory,
                   FaultDirectory, S3) {
  MAKE_STORE(store);
  auto w = store->create("step-1/small");
  REQUIRE_OK(w);
  REQUIRE_OK(w.value()->write(0, "hello", 5));
  REQUIRE_OK(w.value()->finish(5));
  CHECK(store->read_all("step-1/small", 100).value() == "hello");
  auto empty = store->create("step-1/empty");
  REQUIRE_OK(empty);
  REQUIRE_OK(empty.value()->finish(0));
  CHECK(store->size("step-1/empty").value() == 0);

  REQUIRE_OK(store->put("step-10/MANIFEST", "ten"));
  REQUIRE_OK(store->put("LATEST", "1"));
  REQUIRE_OK(store->put("LATEST", "10"));
  CHECK(store->read_all("LATEST", 100).value() == "10");

  auto under = store->list("step-1/");
  REQUIRE_OK(under);
  REQUIRE(under.value().size() == 2);
  CHECK(under.value()[0].key == "step-1/empty");
  CHECK(under.value()[1].key == "step-1/small");
  CHECK(under.value()[1].size == 5);
  // One level down: objects and sub-prefixes, each once.
  auto top = store->children("");
  REQUIRE_OK(top);
  CHECK(top.value() == std::vector<std::string>{"LATEST", "step-1", "step-10"});
  auto in_step = store->children("step-1/");
  REQUIRE_OK(in_step);
  CHECK(in_step.value() == std::vector<std::string>{"empty", "small"});
  CHECK(store->children("step-2/").value().empty());
  // A prefix is a string prefix, not a directory.
  auto steps = store->list("step-1");
  REQUIRE_OK(steps);
  CHECK(steps.value().size() == 3);
  auto everything = store->list("");
  REQUIRE_OK(everything);
  REQUIRE(everything.value().size() == 4);
  CHECK(everything.value()[0].key == "LATEST");

  REQUIRE_OK(store->remove({"step-1/small", "step-1/never-there"}));
  CHECK(store->size("step-1/small").status().code() == StatusCode::not_found);
  CHECK(store->read_all("step-1/small", 10).status().code() == StatusCode::not_found);
  CHECK(store->list("step-1/").value().size() == 1);
}

TEMPLATE_TEST_CASE("store: create-once has exactly one winner among racing writers", "[store]",
                   Directory, FaultDirectory, S3) {
  MAKE_STORE(store);
  const int n = 12;
  std::vector<Status> results(n);
  std::vector<std::thread> threads;
  std::atomic<bool> go{false};
  for (int i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      while (!go) std::this_thread::yield();
      results[i] = store->put_if_absent("step-7/MANIFEST", "writer " + std::to_string(i));
    });
  go = true;
  for (auto& t : threads) t.join();
  int winners = 0, winner = -1;
  for (int i = 0; i < n; ++i) {
    if (results[i].ok()) {
      ++winners;
      winner = i;
    } else {
      INFO(results[i].to_string());
      CHECK(results[i].code() == StatusCode::already_exists);
      CHECK(results[i].message().find("step-7/MANIFEST") != std::string::npos);
    }
  }
  REQUIRE(winners == 1);
  CHECK(store->read_all("step-7/MANIFEST", 100).value() == "writer " + std::to_string(winner));
  // Nothing else was left behind by the losers.
  CHECK(store->list("").value().size() == 1);
}

TEMPLATE_TEST_CASE("store: an aborted or incomplete object leaves nothing, and bad keys are named",
                   "[store]", Directory, FaultDirectory, S3) {
  MAKE_STORE(store);
  const uint64_t part = std::max<uint64_t>(store->part_bytes(), 1u << 20);
  const std::string data = pattern(2 * part, 3);
  {
    auto w = store->create("step-2/data-0.bin");
    REQUIRE_OK(w);
    REQUIRE_OK(w.value()->write(0, data.data(), part));
    REQUIRE_OK(w.value()->abort());
  }
  {
    auto w = store->create("step-2/data-1.bin");
    REQUIRE_OK(w);
    REQUIRE_OK(w.value()->write(part, data.data() + part, part));
    // Part 1 was never written.
    Status s = w.value()->finish(data.size());
    CHECK_FALSE(s.ok());
  }
  {
    auto w = store->create("step-2/data-2.bin");
    REQUIRE_OK(w);
    REQUIRE_OK(w.value()->write(0, data.data(), part));
    // Dropped unfinished, as a failed save does.
  }
  CHECK(store->list("").value().empty());

  for (const char* bad : {"../escape", "/abs", "a//b", "a/./b", "x/", "ctl\nkey", ""}) {
    INFO(bad);
    Status s = store->put(bad, "x");
    CHECK(s.code() == StatusCode::invalid_argument);
    if (*bad) CHECK(s.message().find(bad) != std::string::npos);
    CHECK_FALSE(store->create(bad).ok());
  }
  CHECK(store->list("").value().empty());
}

TEST_CASE("store: a directory store follows no link planted below its root", "[store]") {
  testing::TempDir tmp;
  auto store = directory_store(posix_filesystem(), tmp.sub("root"));
  REQUIRE_OK(store);
  std::filesystem::create_directories(tmp.sub("outside"));
  {
    std::ofstream secret(tmp.sub("outside/secret"));
    secret << "not yours";
  }
  std::filesystem::create_directory_symlink(tmp.sub("outside"), tmp.sub("root/step-1"));
  CHECK_FALSE(store.value()->put("step-1/MANIFEST", "x").ok());
  CHECK_FALSE(store.value()->put_if_absent("step-1/LATEST", "x").ok());
  CHECK_FALSE(store.value()->create("step-1/data").ok());
  CHECK_FALSE(store.value()->read_all("step-1/secret", 100).ok());
  std::string buf(10, '\0');
  CHECK_FALSE(store.value()->read("step-1/secret", 0, buf.data(), buf.size()).ok());
  CHECK(store.value()->list("").value().empty());
  (void)store.value()->remove({"step-1/secret"});
  // Nothing outside was created, changed or removed.
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(tmp.sub("outside")))
    names.push_back(e.path().filename().string());
  CHECK(names == std::vector<std::string>{"secret"});
}

TEST_CASE("store: a create-once that fails or is cut leaves nothing behind (fault filesystem)",
          "[store][faults]") {
  testing::TempDir tmp;
  auto fs = std::make_shared<FaultFilesystem>(posix_filesystem());
  auto store = directory_store(fs, tmp.sub("root"));
  REQUIRE_OK(store);
  FaultRule r;
  r.op = FaultOp::rename;
  r.error = EIO;
  r.nth = 1;
  fs->add_rule(r);
  Status s = store.value()->put_if_absent("step-1/MANIFEST", "m");
  CHECK(s.code() == StatusCode::io_error);
  CHECK(s.message().find("step-1/MANIFEST") != std::string::npos);
  CHECK(store.value()->list("").value().empty());
  fs->clear_rules();
  // A create-once whose directory was synced survives a power cut; the
  // directory store syncs before it returns.
  REQUIRE_OK(store.value()->put_if_absent("step-1/MANIFEST", "m"));
  REQUIRE_OK(fs->power_cut());
  CHECK(store.value()->read_all("step-1/MANIFEST", 10).value() == "m");
  CHECK(store.value()->put_if_absent("step-1/MANIFEST", "n").code() == StatusCode::already_exists);
}
