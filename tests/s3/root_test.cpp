// s3:// roots end to end against the suite's server: ranks save through the
// runtime into a bucket prefix and other rank counts load it resharded, the
// MANIFEST object is the commit point, and the catalog reads the root.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>

#include "catalog.hpp"
#include "ferry/catalog.hpp"
#include "ferry/runtime.hpp"
#include "manifest.hpp"
#include "multiproc/launch.hpp"
#include "object_fs.hpp"
#include "runtime_rig.hpp"
#include "s3_server.hpp"

using namespace ferry;

namespace {

// A fresh bucket with the root s3://<bucket>/run1; the ranks (and runtimes
// in this process) find the credentials in the AWS_* variables, the
// endpoint in their s3-endpoint setting.
struct S3Root {
  std::string root;
  std::string endpoint;
  std::shared_ptr<Filesystem> fs;  // the local filesystem and s3:// roots, as a runtime has
  std::unique_ptr<s3::Client> client;
  std::string bucket;
};

S3Root make_root(const testing::S3Server& server) {
  S3Root r;
  auto c = s3::Client::create(server.config);
  REQUIRE(c.ok());
  r.client = std::move(c).value();
  r.bucket = testing::fresh_bucket();
  REQUIRE_OK(r.client->create_bucket(r.bucket, s3::Deadline::in(std::chrono::seconds(30))));
  setenv("AWS_ACCESS_KEY_ID", server.config.access_key.c_str(), 1);
  setenv("AWS_SECRET_ACCESS_KEY", server.config.secret_key.c_str(), 1);
  setenv("AWS_REGION", server.config.region.c_str(), 1);
  r.root = "s3://" + r.bucket + "/run1";
  r.endpoint = server.config.endpoint;
  Options o;
  o.s3_endpoint = r.endpoint;
  r.fs = with_object_roots(posix_filesystem(), [o] { return s3_store_options(o); });
  return r;
}

std::vector<std::string> keys_under(S3Root& r, const std::string& prefix) {
  auto l = r.client->list(r.bucket, prefix, s3::Deadline::in(std::chrono::seconds(30)));
  REQUIRE_OK(l);
  std::vector<std::string> keys;
  for (const auto& o : l.value()) keys.push_back(o.key);
  return keys;
}

std::vector<uint8_t> pattern(size_t n, uint64_t seed) {
  std::vector<uint8_t> b(n);
  std::mt19937_64 rng(seed);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

}  // namespace

TEST_CASE("2 ranks save to s3:// and 3 ranks load it resharded, every byte checked", "[s3][root]") {
  FERRY_S3_SERVER(server);
  S3Root r = make_root(server);
  const std::string set = " --set s3-endpoint=" + r.endpoint;
  struct Case {
    std::string compress;
    uint64_t step;
    int seed;
  };
  for (const Case& c : {Case{"none", 1, 7}, Case{"zstd", 2, 9}}) {
    INFO("compress " << c.compress);
    auto saved = testing::launch(
        2, "--mode save --root " + r.root + " --step " + std::to_string(c.step) + " --seed " +
               std::to_string(c.seed) + " --set compress=" + c.compress + set);
    INFO(saved.out);
    REQUIRE(saved.code == 0);
    CHECK(testing::count(saved.out, "SAVED") == 2);

    auto latest = find_latest(*r.fs, r.root);
    REQUIRE_OK(latest);
    CHECK(latest->path == r.root + "/" + step_dir_name(c.step));
    auto m = read_manifest(*r.fs, latest->path);
    REQUIRE_OK(m);
    CHECK(m->world_size == 2);
    // The data objects stay where they were written, under the save's own prefix.
    for (const auto& f : m->files) CHECK(f.name.rfind("save-", 0) == 0);
    bool compressed = false;
    for (const auto& t : m->tensors)
      for (const auto& ch : t.chunks) compressed |= !ch.codec.empty();
    CHECK(compressed == (c.compress != "none"));
    // No lease is left behind by a committed save.
    for (const auto& k : keys_under(r, "run1/" + step_dir_name(c.step) + "/"))
      CHECK(k.find("LEASE") == std::string::npos);

    testing::check_loads(3, "--seed " + std::to_string(c.seed) + set, r.root);
    testing::check_loads(1, "--seed " + std::to_string(c.seed) + set, r.root);
  }
  auto listed = Catalog(r.fs).list(r.root);
  REQUIRE_OK(listed);
  REQUIRE(listed->size() == 2);
  CHECK(listed->back().latest_hint);
}

TEST_CASE(
    "a save whose MANIFEST put fails leaves the last checkpoint the latest and its step prefix "
    "is no checkpoint",
    "[s3][root]") {
  FERRY_S3_SERVER(server);
  S3Root r = make_root(server);
  std::vector<uint8_t> bytes = pattern(3 << 20, 5);
  StateDict sd;
  REQUIRE_OK(sd.add("w", TensorView{bytes.data(), DType::u8, {int64_t(bytes.size())}}));
  {
    auto rt = testing::make_test_runtime(r.root, {{{"s3-endpoint", r.endpoint}}});
    auto h = rt->save_async(sd, 1);
    REQUIRE_OK(h.wait_committed());
    CHECK(h.path() == r.root + "/step-00000001");
    CHECK(rt->latest() == h.path());
  }
  {
    // The create-once PUT of step 2's MANIFEST fails: nothing is committed.
    setenv("FERRY_FAULTS", "eio:rename:1:path=step-00000002/MANIFEST", 1);
    auto rt = testing::make_test_runtime(r.root, {{{"s3-endpoint", r.endpoint}}});
    unsetenv("FERRY_FAULTS");
    auto h = rt->save_async(sd, 2);
    Status s = h.wait_committed();
    INFO(s.to_string());
    REQUIRE_FALSE(s.ok());
    CHECK(s.message().find("step-00000002/MANIFEST") != std::string::npos);
    CHECK(rt->latest() == r.root + "/step-00000001");
  }
  // Whatever the failed save left under step 2 (a failed save removes its
  // own prefix; a crashed one cannot) is no checkpoint: plant a data object.
  REQUIRE_OK(r.client->put(r.bucket, "run1/step-00000002/save-x/rank-00000-0000.safetensors", "x",
                           1, {}, s3::Deadline::in(std::chrono::seconds(30))));
  auto listed = Catalog(r.fs).list(r.root);
  REQUIRE_OK(listed);
  REQUIRE(listed->size() == 1);
  CHECK(listed->front().step == 1);
  auto latest = Catalog(r.fs).latest(r.root);
  REQUIRE_OK(latest);
  CHECK(latest->path == r.root + "/step-00000001");

  // Loads step 1 whole, every block checked against the manifest.
  std::vector<uint8_t> back(bytes.size(), 0);
  StateDict into;
  REQUIRE_OK(into.add("w", TensorView{back.data(), DType::u8, {int64_t(back.size())}}));
  auto rt = testing::make_test_runtime(r.root, {{{"s3-endpoint", r.endpoint}}});
  REQUIRE_OK(rt->load(into, r.root));
  CHECK(back == bytes);

  // Saving step 1 again is refused: its MANIFEST exists.
  auto again = rt->save_async(sd, 1);
  Status s = again.wait_committed();
  REQUIRE_FALSE(s.ok());
  CHECK(s.code() == StatusCode::already_exists);
  CHECK(s.message().find("step-00000001") != std::string::npos);
}

TEST_CASE(
    "a flipped byte in an s3:// data object fails the load naming the file, errors name "
    "the object, the operation and the HTTP status",
    "[s3][root]") {
  FERRY_S3_SERVER(server);
  S3Root r = make_root(server);
  std::vector<uint8_t> bytes = pattern(1 << 20, 6);
  StateDict sd;
  REQUIRE_OK(sd.add("w", TensorView{bytes.data(), DType::u8, {int64_t(bytes.size())}}));
  auto rt = testing::make_test_runtime(r.root, {{{"s3-endpoint", r.endpoint}}});
  auto h = rt->save_async(sd, 1);
  REQUIRE_OK(h.wait_committed());
  auto m = read_manifest(*r.fs, h.path());
  REQUIRE_OK(m);
  REQUIRE(m->files.size() == 1);
  const std::string key = "run1/step-00000001/" + m->files[0].name;
  auto d = s3::Deadline::in(std::chrono::seconds(30));
  auto obj = r.client->get_all(r.bucket, key, 64 << 20, d);
  REQUIRE_OK(obj);
  std::string flipped = obj.value();
  flipped[m->tensors[0].chunks[0].byte_offset + 1000] ^= 0x5a;
  REQUIRE_OK(r.client->put(r.bucket, key, flipped.data(), flipped.size(), {}, d));

  std::vector<uint8_t> back(bytes.size(), 0);
  StateDict into;
  REQUIRE_OK(into.add("w", TensorView{back.data(), DType::u8, {int64_t(back.size())}}));
  Status s = rt->load(into, r.root);
  INFO(s.to_string());
  REQUIRE_FALSE(s.ok());
  CHECK(s.message().find(m->files[0].name) != std::string::npos);

  // A root in a bucket that is not there: the error names the bucket's
  // object, the request and the status.
  auto none = Catalog(r.fs).latest("s3://" + r.bucket + "-none/run1");
  REQUIRE_FALSE(none.ok());
  INFO(none.status().to_string());
  CHECK(none.status().message().find("HTTP 404") != std::string::npos);
  CHECK(none.status().message().find(r.bucket + "-none") != std::string::npos);
}

TEST_CASE(
    "gc on an s3:// root removes unnamed save prefixes whose lease lapsed and aborts their "
    "uploads, keeps leased ones, and never touches keys outside the root",
    "[s3][root][gc]") {
  FERRY_S3_SERVER(server);
  S3Root r = make_root(server);
  std::vector<uint8_t> bytes = pattern(1 << 20, 8);
  StateDict sd;
  REQUIRE_OK(sd.add("w", TensorView{bytes.data(), DType::u8, {int64_t(bytes.size())}}));
  {
    auto rt = testing::make_test_runtime(r.root, {{{"s3-endpoint", r.endpoint}}});
    REQUIRE_OK(rt->save_async(sd, 1).wait_committed());
  }
  const int64_t now = now_unix_ms();
  auto d = [] { return s3::Deadline::in(std::chrono::seconds(30)); };
  auto put = [&](const std::string& key, const std::string& text) {
    REQUIRE_OK(r.client->put(r.bucket, key, text.data(), text.size(), {}, d()));
  };
  const std::string lapsed = std::to_string(now - 1000) + " j/dead/1\n";
  // A crashed save of step 2: lease lapsed, a data object and an unfinished upload.
  put("run1/step-00000002/save-dead/LEASE", lapsed);
  put("run1/step-00000002/save-dead/rank-00000-0000.safetensors", "data");
  auto dead_upload =
      r.client->create_multipart(r.bucket, "run1/step-00000002/save-dead/rank-00000-0001", d());
  REQUIRE_OK(dead_upload);
  // A leftover beside committed step 1 that its MANIFEST does not name, no lease.
  put("run1/step-00000001/save-old/rank-00000-0000.safetensors", "old");
  // A save in flight: leased for an hour, its upload going on.
  put("run1/step-00000003/save-live/LEASE", std::to_string(now + 3'600'000) + " j/live/1\n");
  put("run1/step-00000003/save-live/rank-00000-0000.safetensors", "live");
  REQUIRE_OK(
      r.client->create_multipart(r.bucket, "run1/step-00000003/save-live/rank-00000-0001", d()));
  // Another root beside this one ("run10" starts with "run1"): never touched.
  put("run10/step-00000002/save-dead/LEASE", lapsed);
  REQUIRE_OK(
      r.client->create_multipart(r.bucket, "run10/step-00000002/save-dead/rank-00000-0001", d()));

  GcOptions o;
  o.now_unix_ms = now + 120'000;  // past the uploads' grace
  auto rep = Catalog(r.fs).gc(r.root, o);
  REQUIRE_OK(rep);
  std::sort(rep->removed.begin(), rep->removed.end());
  CHECK(rep->removed == std::vector<std::string>{r.root + "/step-00000001/save-old",
                                                 r.root + "/step-00000002/save-dead"});
  CHECK(rep->kept == std::vector<std::string>{r.root + "/step-00000003/save-live"});
  REQUIRE(rep->discarded.size() == 1);
  CHECK(rep->discarded[0].find("step-00000002/save-dead/rank-00000-0001") != std::string::npos);
  CHECK(rep->failed.empty());

  CHECK(keys_under(r, "run1/step-00000002/").empty());
  CHECK(keys_under(r, "run1/step-00000001/save-old/").empty());
  CHECK(keys_under(r, "run1/step-00000003/").size() == 2);
  CHECK(keys_under(r, "run10/").size() == 1);
  auto uploads = r.client->list_multipart(r.bucket, "", d());
  REQUIRE_OK(uploads);
  std::vector<std::string> left;
  for (const auto& u : uploads.value()) left.push_back(u.key);
  std::sort(left.begin(), left.end());
  CHECK(left == std::vector<std::string>{"run1/step-00000003/save-live/rank-00000-0001",
                                         "run10/step-00000002/save-dead/rank-00000-0001"});
  // The committed step is whole: every byte verified.
  auto v = Catalog(r.fs).verify(r.root);
  REQUIRE_OK(v);
}

TEST_CASE("ferry ls, verify, gc and export on an s3:// root", "[s3][root][cli]") {
  FERRY_S3_SERVER(server);
  S3Root r = make_root(server);
  std::vector<uint8_t> bytes = pattern(1 << 20, 9);
  StateDict sd;
  REQUIRE_OK(sd.add("w", TensorView{bytes.data(), DType::u8, {int64_t(bytes.size())}}));
  {
    auto rt = testing::make_test_runtime(r.root, {{{"s3-endpoint", r.endpoint}}});
    REQUIRE_OK(rt->save_async(sd, 4).wait_committed());
  }
  testing::TempDir tmp;
  const std::string ini = tmp.sub("s3.ini");
  {
    std::ofstream out(ini);
    out << "[ferry]\ns3-endpoint = \"" << r.endpoint << "\"\n";
  }
  const std::vector<std::string> env = {"FERRY_CONFIG=" + ini};
  auto ls = testing::run_shell(std::string(FERRY_CLI_PATH) + " ls " + r.root, env);
  INFO(ls.out);
  CHECK(ls.code == 0);
  CHECK(ls.out.find("step-00000004") != std::string::npos);
  CHECK(ls.out.find("LATEST") != std::string::npos);
  auto verify = testing::run_shell(std::string(FERRY_CLI_PATH) + " verify " + r.root, env);
  INFO(verify.out);
  CHECK(verify.code == 0);
  CHECK(verify.out.find("OK") != std::string::npos);
  CHECK(verify.out.find(r.root + "/step-00000004") != std::string::npos);
  auto gc = testing::run_shell(std::string(FERRY_CLI_PATH) + " gc " + r.root, env);
  INFO(gc.out);
  CHECK(gc.code == 0);
  // export reads the object root's latest into one safetensors file: after
  // its 8-byte header length and header, the tensor's bytes as saved.
  const std::string out_dir = tmp.sub("export");
  auto exported =
      testing::run_shell(std::string(FERRY_CLI_PATH) + " export " + r.root + " " + out_dir, env);
  INFO(exported.out);
  CHECK(exported.code == 0);
  std::ifstream st(out_dir + "/model-00001-of-00001.safetensors", std::ios::binary);
  REQUIRE(st);
  std::vector<char> file((std::istreambuf_iterator<char>(st)), std::istreambuf_iterator<char>());
  REQUIRE(file.size() >= 8);
  uint64_t header = 0;
  std::memcpy(&header, file.data(), 8);
  REQUIRE(file.size() == 8 + header + bytes.size());
  CHECK(std::memcmp(file.data() + 8 + header, bytes.data(), bytes.size()) == 0);
  CHECK(std::ifstream(out_dir + "/model.safetensors.index.json").good());
  // No secret in anything the CLI printed.
  for (const auto* o : {&ls.out, &verify.out, &gc.out, &exported.out})
    CHECK(o->find(server.config.secret_key) == std::string::npos);
}

TEST_CASE("an overwrite on an s3:// root commits beside the old save's objects, then deletes them",
          "[s3][root]") {
  FERRY_S3_SERVER(server);
  S3Root r = make_root(server);
  std::vector<uint8_t> first = pattern(1 << 20, 10), second = pattern(1 << 20, 11);
  auto rt = testing::make_test_runtime(r.root, {{{"s3-endpoint", r.endpoint}}});
  auto save = [&](std::vector<uint8_t>& bytes, bool overwrite) {
    StateDict sd;
    REQUIRE_OK(sd.add("w", TensorView{bytes.data(), DType::u8, {int64_t(bytes.size())}}));
    SaveOptions o;
    o.overwrite = overwrite;
    REQUIRE_OK(rt->save_async(sd, 1, o).wait_committed());
  };
  save(first, false);
  auto old = read_manifest(*r.fs, r.root + "/step-00000001");
  REQUIRE_OK(old);
  save(second, true);
  auto now = read_manifest(*r.fs, r.root + "/step-00000001");
  REQUIRE_OK(now);
  CHECK(now->commit_seq == old->commit_seq + 1);
  const std::string old_prefix = old->files[0].name.substr(0, old->files[0].name.find('/'));
  CHECK(now->files[0].name.rfind(old_prefix, 0) != 0);

  std::vector<uint8_t> back(second.size(), 0);
  StateDict into;
  REQUIRE_OK(into.add("w", TensorView{back.data(), DType::u8, {int64_t(back.size())}}));
  REQUIRE_OK(rt->load(into, r.root));
  CHECK(back == second);
  // The old objects go in the background, at the latest when the runtime ends.
  rt.reset();
  CHECK(keys_under(r, "run1/step-00000001/" + old_prefix + "/").empty());
  CHECK_FALSE(keys_under(r, "run1/step-00000001/").empty());
}
