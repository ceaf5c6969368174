// The crash matrix on an s3:// root: the scenarios of every kill point
// (tests/multiproc/kill_scenarios.hpp) run against the suite's S3 server. A
// SIGKILL at each point an S3 save or load passes leaves the old or the new
// checkpoint whole: the latest loads with every byte checked, a step whose
// MANIFEST was not put is invisible, and gc past the leases leaves only the
// committed checkpoints' objects and no unfinished multipart upload.

#include <algorithm>
#include <cstdlib>

#include "catalog.hpp"
#include "manifest.hpp"
#include "multiproc/kill_scenarios.hpp"
#include "object_fs.hpp"
#include "s3_server.hpp"

using namespace ferry;
using testing::CrashRoot;
using testing::CrashRootKind;

namespace {

// Points an object root never passes, each with the reason (the runner
// checks that a save killed there completes instead).
const std::map<std::string, std::string> kUnreachedOnS3 = {
    {"manifest.rename", "the MANIFEST is one create-once PUT (commit.rename), no file renamed"},
    {"manifest.dirsync", "no directory to fsync: an object is durable when its PUT returns"},
    {"latest.fsync", "LATEST is a hint object, put without a sync"},
    {"overwrite.aside", "an overwrite puts its MANIFEST over the old one; nothing is moved aside"},
    {"root.fsync", "no directory to fsync: an object is durable when its PUT returns"},
    {"gc.delete",
     "a save does not gc an object root (that is `ferry gc`, root_test.cpp); it deletes "
     "nothing before its commit"},
};

auto deadline() {
  return s3::Deadline::in(std::chrono::seconds(30));
}

CrashRootKind s3_kind(const testing::S3Server& server) {
  setenv("AWS_ACCESS_KEY_ID", server.config.access_key.c_str(), 1);
  setenv("AWS_SECRET_ACCESS_KEY", server.config.secret_key.c_str(), 1);
  setenv("AWS_REGION", server.config.region.c_str(), 1);
  CrashRootKind kind;
  kind.name = "s3";
  kind.unreached = kUnreachedOnS3;
  kind.make = [config = server.config] {
    auto made = s3::Client::create(config);
    REQUIRE(made.ok());
    std::shared_ptr<s3::Client> client = std::move(made).value();
    const std::string bucket = testing::fresh_bucket();
    REQUIRE_OK(client->create_bucket(bucket, deadline()));
    CrashRoot r;
    r.root = "s3://" + bucket + "/run1";
    r.worker_args = " --set s3-endpoint=" + config.endpoint;
    r.gc_grace_ms = 0;  // a killed writer's uploads are as old as its lapsed lease
    Options o;
    o.s3_endpoint = config.endpoint;
    r.fs = with_object_roots(posix_filesystem(), [o] { return s3_store_options(o); });
    r.check_clean = [client, bucket, fs = r.fs, root = r.root] {
      // Each key is LATEST, a step's MANIFEST, or under a save prefix that
      // step's MANIFEST names.
      auto keys = client->list(bucket, "run1/", deadline());
      REQUIRE_OK(keys);
      for (const auto& k : keys.value()) {
        const std::string rel = k.key.substr(5);
        INFO("left in the bucket: " << k.key);
        if (rel == "LATEST") continue;
        const auto slash = rel.find('/');
        REQUIRE(slash != std::string::npos);
        const std::string step = rel.substr(0, slash), rest = rel.substr(slash + 1);
        CHECK(parse_step_dir_name(step, nullptr));
        if (rest == "MANIFEST") continue;
        // A committed save's lease goes too, also when its saver died first.
        CHECK(rest.substr(rest.find('/') + 1) != "LEASE");
        auto m = read_manifest(*fs, root + "/" + step);
        REQUIRE_OK(m);
        const std::string prefix = rest.substr(0, rest.find('/'));
        bool named = false;
        for (const auto& f : m->files) named |= f.name.rfind(prefix + "/", 0) == 0;
        CHECK(named);
      }
      auto uploads = client->list_multipart(bucket, "run1/", deadline());
      REQUIRE_OK(uploads);
      for (const auto& u : uploads.value()) INFO("unfinished upload: " << u.key);
      CHECK(uploads.value().empty());
    };
    r.keep = client;
    return r;
  };
  return kind;
}

const bool kS3KillPointCasesRegistered = testing::kill_scenarios::register_kill_point_cases(
    "on an s3:// root, ", "[s3][killpoints]", [](const KillPointInfo& kp) {
      FERRY_S3_SERVER(server);
      testing::kill_scenarios::crash_at_kill_point(s3_kind(server), kp);
    });

}  // namespace
