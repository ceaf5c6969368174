// FERRY_FAULTS http: rules (src/drills/http_faults.*) against the suite's S3
// server: the S3 client's attempts chosen by operation and key fail as a
// sick server would (503 SlowDown, 500, reset connections, truncated bodies,
// stalled responses), and each phase of a save and a load goes through them:
// transient faults are retried (counted) and the save or load succeeds;
// persistent ones fail the save naming the object, the operation and the
// HTTP status, commit nothing, leave no unfinished upload, and the previous
// checkpoint stays the latest; a stalled response is bounded by the phase.
#include <chrono>
#include <cstdlib>
#include <random>

#include "catalog.hpp"
#include "drills/fault_fs.hpp"
#include "drills/http_faults.hpp"
#include "ferry/catalog.hpp"
#include "ferry/runtime.hpp"
#include "manifest.hpp"
#include "object_fs.hpp"
#include "runtime_rig.hpp"
#include "s3_server.hpp"

using namespace ferry;

namespace {

auto deadline() {
  return s3::Deadline::in(std::chrono::seconds(30));
}

std::vector<uint8_t> pattern(size_t n, uint64_t seed) {
  std::vector<uint8_t> b(n);
  std::mt19937_64 rng(seed);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

// A bucket with root s3://<bucket>/run1 holding a committed step 1.
struct Root {
  std::string bucket, root, endpoint;
  std::unique_ptr<s3::Client> client;
  std::shared_ptr<Filesystem> fs;
  std::vector<uint8_t> first = pattern(20 << 20, 1);  // three 8 MiB parts

  explicit Root(const testing::S3Server& server) {
    auto c = s3::Client::create(server.config);
    REQUIRE(c.ok());
    client = std::move(c).value();
    bucket = testing::fresh_bucket();
    REQUIRE_OK(client->create_bucket(bucket, deadline()));
    setenv("AWS_ACCESS_KEY_ID", server.config.access_key.c_str(), 1);
    setenv("AWS_SECRET_ACCESS_KEY", server.config.secret_key.c_str(), 1);
    setenv("AWS_REGION", server.config.region.c_str(), 1);
    root = "s3://" + bucket + "/run1";
    endpoint = server.config.endpoint;
    Options o;
    o.s3_endpoint = endpoint;
    fs = with_object_roots(posix_filesystem(), [o] { return s3_store_options(o); });
    auto rt = runtime("");
    REQUIRE_OK(rt->save_async(state(first), 1).wait_committed());
  }

  // A runtime whose S3 client goes through `faults` (FERRY_FAULTS), and the
  // injector it uses (null without http: rules).
  std::unique_ptr<Runtime> runtime(const std::string& faults,
                                   std::shared_ptr<HttpFaults>* injector = nullptr,
                                   const std::string& write_timeout = "600s") {
    setenv("FERRY_FAULTS", faults.c_str(), 1);
    auto rt = testing::make_test_runtime(
        root, {{{"s3-endpoint", endpoint}, {"write-timeout", write_timeout}}});
    if (injector) {
      auto h = http_faults_from_env();
      REQUIRE_OK(h);
      *injector = h.value();
      REQUIRE(*injector);
    }
    unsetenv("FERRY_FAULTS");
    return rt;
  }

  static StateDict state(std::vector<uint8_t>& bytes) {
    StateDict sd;
    REQUIRE_OK(sd.add("w", TensorView{bytes.data(), DType::u8, {int64_t(bytes.size())}}));
    return sd;
  }

  // The latest checkpoint is `step` and loads back `bytes`, every byte.
  void check_latest(uint64_t step, std::vector<uint8_t>& bytes) {
    auto latest = Catalog(fs).latest(root);
    REQUIRE_OK(latest);
    CHECK(latest->step == step);
    std::vector<uint8_t> back(bytes.size(), 0);
    auto rt = runtime("");
    StateDict into = state(back);
    REQUIRE_OK(rt->load(into, root));
    CHECK(back == bytes);
  }

  // Nothing but committed checkpoints is listed, every one loadable, and no
  // multipart upload is left open.
  void check_nothing_committed_but(std::vector<uint64_t> steps) {
    auto listed = Catalog(fs).list(root);
    REQUIRE_OK(listed);
    std::vector<uint64_t> got;
    for (const auto& c : *listed) got.push_back(c.step);
    CHECK(got == steps);
    REQUIRE_OK(Catalog(fs).verify(root));
    auto uploads = client->list_multipart(bucket, "run1/", deadline());
    REQUIRE_OK(uploads);
    for (const auto& u : uploads.value()) INFO("unfinished upload " << u.key);
    CHECK(uploads.value().empty());
  }

  // Parts the saved step's data objects took (objects of one part or less
  // are single PUTs).
  uint64_t parts_of(uint64_t step) {
    auto m = read_manifest(*fs, root + "/" + step_dir_name(step));
    REQUIRE_OK(m);
    const uint64_t part = 8ull << 20;
    uint64_t n = 0;
    for (const auto& f : m->files) n += f.size > part ? (f.size + part - 1) / part : 0;
    return n;
  }
};

bool has(const Status& s, const std::string& what) {
  return s.message().find(what) != std::string::npos;
}

}  // namespace

TEST_CASE("http: fault rules parse, print back, and bad ones are refused naming the part",
          "[s3][faults]") {
  auto spec = parse_fault_spec(
      "http:503:part:1-2,http:500:put:1+:key=MANIFEST,http:reset:get:3,http:truncate:get:"
      "rate=1/4:seed=9,http:stall:head:1,http:latency:list:5ms,http:404:any:2:code=NoSuchKey,"
      "eio:write:1");
  REQUIRE_OK(spec);
  REQUIRE(spec->http_rules.size() == 7);
  CHECK(spec->rules.size() == 1);
  CHECK(spec->http_rules[0].to_string() == "http:503:part:1-2:code=SlowDown");
  CHECK(spec->http_rules[1].to_string() == "http:500:put:1+:code=InternalError:key=MANIFEST");
  CHECK(spec->http_rules[2].to_string() == "http:reset:get:3");
  CHECK(spec->http_rules[3].to_string() == "http:truncate:get:rate=1/4:seed=9");
  CHECK(spec->http_rules[4].to_string() == "http:stall:head:1");
  CHECK(spec->http_rules[5].to_string() == "http:latency:list:5000us");
  CHECK(spec->http_rules[6].to_string() == "http:404:any:2:code=NoSuchKey");
  for (const char* bad : {"http:999:put:1", "http:503:post:1", "http:503:put", "http:503:put:0",
                          "http:503:put:3-2", "http:latency:get:5", "http:reset:put:1:code=X",
                          "http:503:put:1:seed=2", "http:503:put:1:what=1"}) {
    auto r = parse_fault_spec(bad);
    INFO(bad);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().message().find(bad) != std::string::npos);
  }
  // The filesystem wrapper ignores http: rules: a spec of only those wraps nothing.
  auto base = posix_filesystem();
  auto fs = filesystem_from_spec(base, "http:503:part:1");
  REQUIRE_OK(fs);
  CHECK(fs.value() == base);
}

TEST_CASE(
    "transient S3 faults in every phase of a save and a load are retried, counted, and the "
    "checkpoint loads whole",
    "[s3][faults]") {
  FERRY_S3_SERVER(server);
  Root r(server);
  struct Case {
    const char* spec;
    const char* op;   // the rule's operation, whose attempts are counted
    uint64_t faults;  // attempts it fails
  };
  const Case cases[] = {
      {"http:503:part:1-2", "part", 2},           // SlowDown on the data's parts
      {"http:500:create:1", "create", 1},         // the multipart upload's start
      {"http:reset:part:2", "part", 1},           // a connection reset mid-save
      {"http:truncate:part:1", "part", 1},        // an answer cut short
      {"http:503:complete:1", "complete", 1},     // the data object's completion
      {"http:503:put:1:key=MANIFEST", "put", 1},  // the commit point
      {"http:reset:put:1:key=LATEST", "put", 1},  // the hint after it
      {"http:503:list:1-2", "list", 2},           // the catalog's listing
      {"http:stall:head:1", "head", 1},           // a HEAD that never answers
      {"http:truncate:head:1", "head", 1},        // a HEAD torn inside its headers
  };
  uint64_t step = 1;
  for (const Case& c : cases) {
    INFO(c.spec);
    ++step;
    std::vector<uint8_t> bytes = pattern(20 << 20, step);
    std::shared_ptr<HttpFaults> faults;
    auto rt = r.runtime(c.spec, &faults, "16s");
    const uint64_t before = faults->attempts(c.op);
    auto h = rt->save_async(Root::state(bytes), step);
    REQUIRE_OK(h.wait_committed());
    CHECK(faults->injected() == c.faults);
    // Each failed attempt was tried again.
    const uint64_t tried = faults->attempts(c.op) - before;
    if (std::string(c.op) == "part") CHECK(tried == r.parts_of(step) + c.faults);
    CHECK(tried > c.faults);
    rt.reset();
    r.check_latest(step, bytes);
  }
  // Loads: a truncated body, a reset and a 503 on the ranged GETs.
  std::vector<uint8_t> last = pattern(20 << 20, step);
  for (const char* spec : {"http:truncate:get:1-2", "http:reset:get:1", "http:503:get:2"}) {
    INFO(spec);
    std::shared_ptr<HttpFaults> faults;
    auto rt = r.runtime(spec, &faults);
    std::vector<uint8_t> back(last.size(), 0);
    StateDict into = Root::state(back);
    REQUIRE_OK(rt->load(into, r.root));
    CHECK(back == last);
    CHECK(faults->injected() >= 1);
  }
  std::vector<uint64_t> all;
  for (uint64_t i = 1; i <= step; ++i) all.push_back(i);
  r.check_nothing_committed_but(all);
}

TEST_CASE(
    "persistent S3 faults fail the save naming the object, the operation and the HTTP status: "
    "nothing is committed, no upload is left open, the previous checkpoint stays the latest",
    "[s3][faults]") {
  FERRY_S3_SERVER(server);
  Root r(server);
  struct Case {
    const char* spec;
    std::vector<std::string> named;  // what the error must say
  };
  const Case cases[] = {
      {"http:500:part:1+", {"UploadPart", "/run1/step-00000002/save-", "HTTP 500 InternalError"}},
      {"http:503:create:1+",
       {"CreateMultipartUpload", "/run1/step-00000002/save-", "HTTP 503 SlowDown"}},
      {"http:403:complete:1+:code=AccessDenied",
       {"CompleteMultipartUpload", "/run1/step-00000002/save-", "HTTP 403 AccessDenied"}},
      {"http:503:put:1+:key=MANIFEST",
       {"PutObject", "/run1/step-00000002/MANIFEST", "HTTP 503 SlowDown"}},
  };
  for (const Case& c : cases) {
    INFO(c.spec);
    std::vector<uint8_t> bytes = pattern(20 << 20, 2);
    std::shared_ptr<HttpFaults> faults;
    auto rt = r.runtime(c.spec, &faults, "30s");
    Status s = rt->save_async(Root::state(bytes), 2).wait_committed();
    INFO(s.to_string());
    REQUIRE_FALSE(s.ok());
    for (const auto& what : c.named) CHECK(has(s, what));
    CHECK(faults->injected() >= 1);
    CHECK(rt->latest() == r.root + "/step-00000001");
    rt.reset();
    r.check_nothing_committed_but({1});
    r.check_latest(1, r.first);
  }
}

TEST_CASE(
    "a stalled S3 response is cut within the write phase: once, the part is retried and the "
    "save succeeds, and always, the save fails within the phase and step 1 stays the latest",
    "[s3][faults]") {
  FERRY_S3_SERVER(server);
  Root r(server);
  using Clock = std::chrono::steady_clock;
  std::vector<uint8_t> second = pattern(20 << 20, 2);
  {
    std::vector<uint8_t>& bytes = second;
    std::shared_ptr<HttpFaults> faults;
    // An attempt gets a quarter of the 12 s phase: the stalled one ends after 3 s.
    auto rt = r.runtime("http:stall:part:1", &faults, "12s");
    const auto t0 = Clock::now();
    REQUIRE_OK(rt->save_async(Root::state(bytes), 2).wait_committed());
    CHECK(Clock::now() - t0 < std::chrono::seconds(12));
    CHECK(faults->injected() == 1);
    rt.reset();
    r.check_latest(2, bytes);
  }
  {
    std::vector<uint8_t> bytes = pattern(20 << 20, 3);
    std::shared_ptr<HttpFaults> faults;
    auto rt = r.runtime("http:stall:part:1+", &faults, "8s");
    const auto t0 = Clock::now();
    Status s = rt->save_async(Root::state(bytes), 3).wait_committed();
    INFO(s.to_string());
    REQUIRE_FALSE(s.ok());
    // The phase (8 s) and the commit's own bound, not curl's 30 s per attempt.
    CHECK(Clock::now() - t0 < std::chrono::seconds(25));
    CHECK(rt->latest() == r.root + "/step-00000002");
    const auto t1 = Clock::now();
    rt.reset();  // nothing left hanging on the stalled connections
    CHECK(Clock::now() - t1 < std::chrono::seconds(15));
    r.check_nothing_committed_but({1, 2});
    r.check_latest(2, second);
  }
}
