#include "ferry/options.hpp"

#include <unistd.h>

#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "config_ini.hpp"
#include "ferry/size.hpp"
#include "test_util.hpp"

namespace {

using ferry::Options;
using ferry::Setting;
using ferry::StatusCode;

void check_defaults(const Options& o) {
  const Options d;
  CHECK(o.root == d.root);
  CHECK(o.pool_bytes == d.pool_bytes);
  CHECK(o.chunk_bytes == d.chunk_bytes);
  CHECK(o.writers == d.writers);
  CHECK(o.direct_io == d.direct_io);
  CHECK(o.fsync == d.fsync);
  CHECK(o.checksum == d.checksum);
  CHECK(o.checksum_block_bytes == d.checksum_block_bytes);
  CHECK(o.keep_last == d.keep_last);
  CHECK(o.fail_fast == d.fail_fast);
  CHECK(o.verify_snapshot == d.verify_snapshot);
  CHECK(o.lease_seconds == d.lease_seconds);
  CHECK(o.readers == d.readers);
  CHECK(o.share_window_bytes == d.share_window_bytes);
  CHECK(o.share_memory == d.share_memory);
  CHECK(o.load_sharing_job == d.load_sharing_job);
  CHECK(o.filename_prefix == d.filename_prefix);
  CHECK(o.shard_size == d.shard_size);
  CHECK(o.compress == d.compress);
  CHECK(o.replica_check == d.replica_check);
  CHECK(o.rejoin_timeout_s == d.rejoin_timeout_s);
  CHECK(o.plan_timeout_s == d.plan_timeout_s);
  CHECK(o.s3_endpoint == d.s3_endpoint);
  CHECK(o.s3_region == d.s3_region);
  CHECK(o.s3_virtual_addressing == d.s3_virtual_addressing);
  CHECK(o.s3_parts_in_flight == d.s3_parts_in_flight);
}

ferry::Result<Options> resolve1(const std::string& key, const std::string& value) {
  return ferry::resolve_options({{key, value, "code"}});
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  REQUIRE(out.good());
}

// Sets or clears an environment variable for one scope, then puts back what
// was there: later tests (and the user's shell value) must not see ours.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// load_options reads caf-application.ini from the working directory, so the
// tests that exercise it run inside a scratch directory.
class ScopedCwd {
 public:
  explicit ScopedCwd(const std::string& dir) {
    char buf[4096];
    REQUIRE(getcwd(buf, sizeof buf) != nullptr);
    old_ = buf;
    REQUIRE(chdir(dir.c_str()) == 0);
  }
  ~ScopedCwd() { (void)chdir(old_.c_str()); }
  ScopedCwd(const ScopedCwd&) = delete;
  ScopedCwd& operator=(const ScopedCwd&) = delete;

 private:
  std::string old_;
};

std::string source_dir() {
  return std::filesystem::path(FERRY_TESTS_DIR).parent_path().string();
}

}  // namespace

TEST_CASE("no settings give the documented defaults", "[options]") {
  auto r = ferry::resolve_options({});
  REQUIRE(r.ok());
  check_defaults(*r);
  CHECK(r->pool_bytes == (1ull << 30));
  CHECK(r->pool_auto);
  CHECK(r->chunk_bytes == (32ull << 20));
  CHECK(r->lease_seconds == 30.0);
}

TEST_CASE("pool-bytes: a size is a fixed pool, auto[:CAP] one sized by use up to CAP",
          "[options]") {
  auto fixed = resolve1("pool-bytes", "256MiB");
  REQUIRE(fixed.ok());
  CHECK_FALSE(fixed->pool_auto);
  CHECK(fixed->pool_bytes == 256ull << 20);
  auto capped = resolve1("pool-bytes", "AUTO:4GiB");
  REQUIRE(capped.ok());
  CHECK(capped->pool_auto);
  CHECK(capped->pool_bytes == 4ull << 30);
  CHECK(capped->chunk_bytes == 32ull << 20);
  for (const char* bad : {"auto:", "auto:0", "autox", "auto 1GiB"}) {
    auto r = resolve1("pool-bytes", bad);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().message().find("ferry.pool-bytes") != std::string::npos);
  }
}

TEST_CASE("option_infos lists every key once, and its defaults resolve to Options{}", "[options]") {
  const std::vector<std::string> expected = {"root",
                                             "pool-bytes",
                                             "chunk-bytes",
                                             "writers",
                                             "copy-threads",
                                             "direct-io",
                                             "fsync",
                                             "checksum",
                                             "checksum-block-bytes",
                                             "keep-last",
                                             "fail-fast",
                                             "verify-snapshot",
                                             "lease-seconds",
                                             "readers",
                                             "read-into-tensors",
                                             "share-window",
                                             "share-memory",
                                             "load-sharing",
                                             "direct-lanes",
                                             "lane-info",
                                             "coordinator-address",
                                             "port",
                                             "connect-timeout",
                                             "heartbeat-interval",
                                             "heartbeat-timeout",
                                             "rejoin-timeout",
                                             "plan-timeout",
                                             "write-timeout",
                                             "commit-timeout",
                                             "owner-policy",
                                             "replica-check",
                                             "cuda-register-pool",
                                             "filename-prefix",
                                             "shard-size",
                                             "compress",
                                             "s3-endpoint",
                                             "s3-region",
                                             "s3-addressing",
                                             "s3-parts-in-flight",
                                             "trace-dir"};
  std::vector<std::string> keys;
  std::vector<Setting> defaults;
  for (const auto& info : ferry::option_infos()) {
    keys.push_back(info.key);
    CHECK(std::string(info.help).size() > 10);
    defaults.push_back({info.key, info.default_value, "option_infos"});
  }
  CHECK(keys == expected);
  auto r = ferry::resolve_options(defaults);
  REQUIRE(r.ok());
  check_defaults(*r);
}

TEST_CASE("each key is parsed into its field", "[options]") {
  auto r = ferry::resolve_options({
      {"root", "/ckpt/run 1", "code"},
      {"pool-bytes", "4GiB", "code"},
      {"chunk-bytes", "16MiB", "code"},
      {"writers", "8", "code"},
      {"direct-io", "off", "code"},
      {"fsync", "no", "code"},
      {"checksum", "0", "code"},
      {"checksum-block-bytes", "64KiB", "code"},
      {"keep-last", "3", "code"},
      {"fail-fast", "yes", "code"},
      {"lease-seconds", "2.5", "code"},
      {"readers", "64", "code"},
      {"share-window", "16MiB", "code"},
  });
  REQUIRE(r.ok());
  CHECK(r->root == "/ckpt/run 1");
  CHECK(r->pool_bytes == 4ull << 30);
  CHECK(r->chunk_bytes == 16ull << 20);
  CHECK(r->writers == 8);
  CHECK_FALSE(r->direct_io);
  CHECK_FALSE(r->fsync);
  CHECK_FALSE(r->checksum);
  CHECK(r->checksum_block_bytes == 64 * 1024);
  CHECK(r->keep_last == 3);
  CHECK(r->fail_fast);
  CHECK(r->lease_seconds == 2.5);
  CHECK(r->readers == 64);
  auto a = ferry::resolve_options({{"readers", "Auto", "code"}});
  REQUIRE(a.ok());
  CHECK(a->readers == 0);  // the loader counts the CPUs
  CHECK(r->share_window_bytes == 16ull << 20);
}

TEST_CASE("save options: filename-prefix, shard-size and compress parse and normalize",
          "[options]") {
  auto r = ferry::resolve_options({{"filename-prefix", "model.v2_A-b", "code"},
                                   {"shard-size", "256MiB", "code"},
                                   {"compress", "true", "code"}});
  REQUIRE(r.ok());
  CHECK(r->filename_prefix == "model.v2_A-b");
  CHECK(r->shard_size == 256ull << 20);
  CHECK(r->compress == "zstd:3");
  CHECK(resolve1("compress", "zstd:19")->compress == "zstd:19");
  CHECK(resolve1("compress", "ZSTD")->compress == "zstd:3");
  CHECK(resolve1("compress", "false")->compress == "none");
  CHECK(resolve1("compress", "none")->compress == "none");
  CHECK(resolve1("shard-size", "unlimited")->shard_size == 0);
}

TEST_CASE("save options: bad values name the option, in config and as C++ fields", "[options]") {
  for (const char* bad : {"", "a/b", "a\\b", "..", "x..y", "sp ace", "caf\xc3\xa9", "a*"}) {
    auto r = resolve1("filename-prefix", bad);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == ferry::StatusCode::invalid_argument);
    CHECK(contains(r.status().message(), "ferry.filename-prefix"));
    ferry::Status s = ferry::check_filename_prefix(bad, "SaveOptions::filename_prefix");
    REQUIRE_FALSE(s.ok());
    CHECK(contains(s.message(), "SaveOptions::filename_prefix"));
  }
  CHECK(ferry::check_filename_prefix("rank", "x").ok());
  for (const char* bad : {"0", "-1", "-4096", "lots", "1.5GiB"}) {
    auto r = resolve1("shard-size", bad);
    REQUIRE_FALSE(r.ok());
    CHECK(contains(r.status().message(), "ferry.shard-size"));
  }
  for (const char* bad : {"gzip", "zstd:0", "zstd:23", "zstd:", "zstd:-1", "lz4:3"}) {
    auto r = resolve1("compress", bad);
    REQUIRE_FALSE(r.ok());
    CHECK(contains(r.status().message(), "ferry.compress"));
    auto p = ferry::parse_compress(bad, "SaveOptions::compress");
    REQUIRE_FALSE(p.ok());
    CHECK(contains(p.status().message(), "SaveOptions::compress"));
  }
}

TEST_CASE("later settings win", "[options]") {
  auto r = ferry::resolve_options({{"writers", "3", "a"}, {"writers", "5", "b"}});
  REQUIRE(r.ok());
  CHECK(r->writers == 5);
}

TEST_CASE("sizes accept decimal and binary suffixes in any case", "[options]") {
  struct Case {
    const char* text;
    uint64_t bytes;
  };
  const Case cases[] = {
      {"4294967296", 4294967296ull},
      {"4096B", 4096},
      {"8k", 8192},
      {"8K", 8192},
      {"8KiB", 8192},
      {"8kib", 8192},
      {"3M", 3ull << 20},
      {"3MiB", 3ull << 20},
      {"2G", 2ull << 30},
      {"2gib", 2ull << 30},
      {"1TiB", 1ull << 40},
      {"1t", 1ull << 40},
      {"5KB", 5000},
      {"5mb", 5000000},
      {"5GB", 5000000000ull},
      {"2TB", 2000000000000ull},
      {" 16 MiB ", 16ull << 20},
  };
  for (const auto& c : cases) {
    INFO(c.text);
    // A chunk small enough that every pool size here holds one.
    auto r =
        ferry::resolve_options({{"chunk-bytes", "4096", "code"}, {"pool-bytes", c.text, "code"}});
    REQUIRE(r.ok());
    CHECK(r->pool_bytes == c.bytes);
  }
  // The largest value that fits, and suffixes that push it over.
  auto max = resolve1("pool-bytes", "18446744073709551615");
  REQUIRE(max.ok());
  CHECK(max->pool_bytes == 18446744073709551615ull);
  for (const char* text : {"18446744073709551616", "16777216TiB", "18446744073709552KB"}) {
    INFO(text);
    auto r = resolve1("pool-bytes", text);
    REQUIRE_FALSE(r.ok());
    CHECK(contains(r.status().message(), "too large"));
  }
}

namespace {

// The cases of tests/size_cases.txt: {text, bytes, or none where refused}.
std::vector<std::pair<std::string, std::optional<uint64_t>>> size_cases() {
  std::ifstream in(FERRY_SIZE_CASES);
  REQUIRE(in);
  std::vector<std::pair<std::string, std::optional<uint64_t>>> cases;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t bar = line.rfind('|');
    REQUIRE(bar != std::string::npos);
    std::string text;
    for (size_t i = 0; i < bar; ++i) {
      if (line[i] != '\\' || i + 1 == bar) {
        text += line[i];
        continue;
      }
      const char e = line[++i];
      text += e == 't'   ? '\t'
              : e == 'n' ? '\n'
              : e == 'r' ? '\r'
              : e == 'f' ? '\f'
              : e == 'v' ? '\v'
                         : e;
    }
    const std::string want = line.substr(bar + 1);
    cases.emplace_back(
        text, want == "refused" ? std::nullopt : std::optional<uint64_t>(std::stoull(want)));
  }
  return cases;
}

}  // namespace

TEST_CASE("parse_size (the CLI's and test workers' size flags) reads what the settings read",
          "[options][size]") {
  // Accepted and refused alike by both: the flags cannot drift from the settings.
  const auto cases = size_cases();
  CHECK(cases.size() > 40);
  for (const auto& [text, bytes] : cases) {
    INFO("'" << text << "'");
    auto size = ferry::parse_size(text);
    REQUIRE(size.ok() == bytes.has_value());
    if (size.ok()) CHECK(*size == *bytes);
    // shard-size takes any positive size.
    if (size.ok() && *size == 0) continue;
    auto setting = resolve1("shard-size", text);
    REQUIRE(size.ok() == setting.ok());
    if (size.ok()) {
      CHECK(*size == setting->shard_size);
      continue;
    }
    CHECK(size.status().code() == StatusCode::invalid_argument);
    // The text, and the setting's own explanation of what is wrong with it.
    CHECK(contains(size.status().message(), "'" + text + "' is not a size"));
    const std::string why = setting.status().message();
    const std::string own = size.status().message();
    CHECK(contains(why, own.substr(own.find("is not a size: ") + 15)));
  }
  // Zero is a size; the setting alone requires a positive one.
  auto zero = ferry::parse_size("0");
  REQUIRE(zero.ok());
  CHECK(*zero == 0);
  CHECK_FALSE(resolve1("shard-size", "0").ok());
}

TEST_CASE("chunk-bytes auto sizes the block to the pool, and a set size is kept", "[options]") {
  struct Case {
    const char* pool;
    uint64_t chunk;
  };
  // 32 MiB, halved while the pool would hold fewer than 8 blocks.
  for (const Case& c :
       {Case{"1GiB", 32ull << 20}, Case{"256MiB", 32ull << 20}, Case{"255MiB", 16ull << 20},
        Case{"16MiB", 2ull << 20}, Case{"1MiB", 128ull << 10}, Case{"512KiB", 64ull << 10},
        Case{"64KiB", 64ull << 10}}) {
    INFO(c.pool);
    for (bool spelled : {false, true}) {
      std::vector<ferry::Setting> s = {{"pool-bytes", c.pool, "code"}};
      if (spelled) s.push_back({"chunk-bytes", "Auto", "code"});
      auto r = ferry::resolve_options(s);
      REQUIRE(r.ok());
      CHECK(r->chunk_bytes == c.chunk);
    }
  }
  // A size set in one place and auto in a later one: the later wins.
  auto later =
      ferry::resolve_options({{"chunk-bytes", "1MiB", "a.ini:2"}, {"chunk-bytes", "auto", "code"}});
  REQUIRE(later.ok());
  CHECK(later->chunk_bytes == 32ull << 20);
  // A size the user set is never shrunk.
  auto kept =
      ferry::resolve_options({{"pool-bytes", "64MiB", "code"}, {"chunk-bytes", "32MiB", "code"}});
  REQUIRE(kept.ok());
  CHECK(kept->chunk_bytes == 32ull << 20);
}

TEST_CASE("booleans and durations accept their spellings", "[options]") {
  for (const char* t : {"true", "TRUE", "on", "On", "yes", "1"}) {
    INFO(t);
    auto r = resolve1("fail-fast", t);
    REQUIRE(r.ok());
    CHECK(r->fail_fast);
  }
  for (const char* f : {"false", "False", "off", "OFF", "no", "0"}) {
    INFO(f);
    auto r = resolve1("direct-io", f);
    REQUIRE(r.ok());
    CHECK_FALSE(r->direct_io);
  }
  struct Case {
    const char* text;
    double seconds;
  };
  for (const Case& c : {Case{"30", 30.0}, Case{"2.5", 2.5}, Case{"30s", 30.0}, Case{"500ms", 0.5},
                        Case{"1.5 S", 1.5}, Case{"250MS", 0.25}}) {
    INFO(c.text);
    auto r = resolve1("lease-seconds", c.text);
    REQUIRE(r.ok());
    CHECK(r->lease_seconds == Approx(c.seconds));
  }
}

TEST_CASE("a bad value for any key names the key, the value and its origin", "[options]") {
  struct Case {
    const char* key;
    const char* value;
    const char* why;  // a fragment of the explanation
  };
  const Case cases[] = {
      {"pool-bytes", "abc", "expected a size like 512MiB"},
      {"pool-bytes", "-1", "negative"},
      {"pool-bytes", "0", "positive"},
      {"pool-bytes", "1.5GiB", "expected a size"},
      {"pool-bytes", "12 parsecs", "expected a size"},
      {"pool-bytes", "", "expected a size"},
      {"chunk-bytes", "1000", "multiple of 4096"},
      {"chunk-bytes", "0", "multiple of 4096"},
      {"chunk-bytes", "2GiB", "at most 1GiB"},
      {"chunk-bytes", "8MB", "multiple of 4096"},
      {"writers", "0", "1 to 64"},
      {"writers", "65", "1 to 64"},
      {"writers", "two", "1 to 64"},
      {"writers", "-2", "1 to 64"},
      {"copy-threads", "0", "1 to 64"},
      {"copy-threads", "65", "1 to 64"},
      {"direct-io", "maybe", "true/false"},
      {"fsync", "2", "true/false"},
      {"checksum", "", "true/false"},
      {"checksum-block-bytes", "0", "multiple of 4096"},
      {"checksum-block-bytes", "6000", "multiple of 4096"},
      {"checksum-block-bytes", "1x", "expected a size"},
      {"keep-last", "-1", "0 or more"},
      {"keep-last", "4294967296", "0 or more"},
      {"keep-last", "1.5", "0 or more"},
      {"fail-fast", "yep", "true/false"},
      {"lease-seconds", "0", "greater than 0"},
      {"lease-seconds", "0ms", "greater than 0"},
      {"lease-seconds", "-5", "duration"},
      {"lease-seconds", "5min", "duration"},
      {"lease-seconds", "inf", "duration"},
      {"lease-seconds", "nan", "duration"},
      {"lease-seconds", "1e3", "duration"},
      {"readers", "0", "1 to 64"},
      {"readers", "100", "1 to 64"},
      {"share-window", "0", "multiple of 4096"},
      {"share-window", "5000", "multiple of 4096"},
      {"share-window", "2GiB", "at most 1GiB"},
      {"port", "65536", "port number"},
      {"port", "http", "port number"},
      {"heartbeat-timeout", "0", "greater than 0"},
      {"write-timeout", "soon", "duration"},
      {"owner-policy", "random", "balanced or lowest-rank"},
  };
  for (const auto& c : cases) {
    INFO(c.key << " = " << c.value);
    auto r = ferry::resolve_options({{c.key, c.value, "caf-application.ini:3"}});
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::invalid_argument);
    const std::string& m = r.status().message();
    CHECK(contains(m, std::string("ferry.") + c.key + " = \"" + c.value + "\""));
    CHECK(contains(m, "(from caf-application.ini:3)"));
    CHECK(contains(m, c.why));
  }
  // The exact wording a user sees for the commonest mistake.
  auto r = ferry::resolve_options({{"pool-bytes", "abc", "caf-application.ini:3"}});
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message().rfind(
            "ferry.pool-bytes = \"abc\" (from caf-application.ini:3): expected a size like 512MiB",
            0) == 0);
}

TEST_CASE("an unknown key is named, with a suggestion and the known keys", "[options]") {
  auto r = resolve1("pool-byte", "1GiB");
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::invalid_argument);
  const std::string& m = r.status().message();
  CHECK(contains(m, "unknown key ferry.pool-byte"));
  CHECK(contains(m, "(from code)"));
  CHECK(contains(m, "did you mean pool-bytes?"));
  CHECK(contains(m, "known keys: root, pool-bytes, chunk-bytes"));

  auto snake = resolve1("pool_bytes", "1GiB");
  REQUIRE_FALSE(snake.ok());
  CHECK(contains(snake.status().message(), "unknown key ferry.pool_bytes"));
  CHECK(contains(snake.status().message(), "did you mean pool-bytes?"));

  auto snake2 = resolve1("checksum_block_bytes", "4096");
  REQUIRE_FALSE(snake2.ok());
  CHECK(contains(snake2.status().message(), "did you mean checksum-block-bytes?"));

  auto far = resolve1("compression", "zstd");
  REQUIRE_FALSE(far.ok());
  CHECK(contains(far.status().message(), "unknown key ferry.compression"));
  CHECK_FALSE(contains(far.status().message(), "did you mean"));
}

TEST_CASE("pool smaller than a chunk names both keys and where they came from", "[options]") {
  auto r = ferry::resolve_options(
      {{"pool-bytes", "16MiB", "code"}, {"chunk-bytes", "32MiB", "a.ini:4"}});
  REQUIRE_FALSE(r.ok());
  const std::string& m = r.status().message();
  CHECK(contains(m, "ferry.pool-bytes = \"16MiB\" (from code)"));
  CHECK(contains(m, "ferry.chunk-bytes = \"32MiB\" (from a.ini:4)"));
  // Below the smallest block auto picks, auto cannot help either.
  auto tiny = resolve1("pool-bytes", "32KiB");
  REQUIRE_FALSE(tiny.ok());
  CHECK(contains(tiny.status().message(), "ferry.chunk-bytes = \"auto (64KiB)\" (from default)"));

  // Checked after every source: a file lowering chunk-bytes later is fine.
  auto ok = ferry::resolve_options(
      {{"pool-bytes", "4MiB", "a.ini:1"}, {"chunk-bytes", "4MiB", "b.ini:2"}});
  REQUIRE(ok.ok());
  CHECK(ok->pool_bytes == ok->chunk_bytes);

  auto both = ferry::resolve_options(
      {{"chunk-bytes", "64MiB", "a.ini:1"}, {"pool-bytes", "32MiB", "b.ini:7"}});
  REQUIRE_FALSE(both.ok());
  CHECK(contains(both.status().message(), "(from a.ini:1)"));
  CHECK(contains(both.status().message(), "(from b.ini:7)"));
}

TEST_CASE("INI: only the ferry section and ferry.-prefixed keys are returned", "[options]") {
  const std::string text =
      "; a comment\n"
      "# another comment\n"
      "ferry.writers = 3\n"
      "other = ignored\n"
      "\n"
      "[scheduler]\n"
      "max-threads = 4 ; CAF's, not ours\n"
      "ferry.readers = 5\n"
      "[ferry]\n"
      "  pool-bytes   =   2GiB   \n"
      "root = \"/data/ckpt ; not a comment # nor this\"  ; a comment\n"
      "fsync=off# trailing\n"
      "lease-seconds = \"500ms\"\r\n"
      "keep-last = \"say \\\"hi\\\" \\\\ done\"\n"
      "[middleman]\n"
      "app-identifiers = [\"a;b\",\n"
      "                   \"c\"]  ; a list across lines\n"
      "[logger]\n"
      "file-name = \"x.log\"\n";
  auto r = ferry::parse_ini_settings(text, "caf-application.ini");
  REQUIRE(r.ok());
  const std::vector<Setting>& s = *r;
  REQUIRE(s.size() == 7);
  CHECK(s[0].key == "writers");
  CHECK(s[0].value == "3");
  CHECK(s[0].origin == "caf-application.ini:3");
  CHECK(s[1].key == "readers");
  CHECK(s[1].origin == "caf-application.ini:8");
  CHECK(s[2].key == "pool-bytes");
  CHECK(s[2].value == "2GiB");
  CHECK(s[2].origin == "caf-application.ini:10");
  CHECK(s[3].key == "root");
  CHECK(s[3].value == "/data/ckpt ; not a comment # nor this");
  CHECK(s[4].key == "fsync");
  CHECK(s[4].value == "off");
  CHECK(s[5].key == "lease-seconds");
  CHECK(s[5].value == "500ms");
  CHECK(s[6].key == "keep-last");
  CHECK(s[6].value == "say \"hi\" \\ done");
  CHECK(s[6].origin == "caf-application.ini:14");
}

TEST_CASE("INI: syntax errors name the origin and the line", "[options]") {
  struct Case {
    const char* text;
    const char* where;
    const char* what;
  };
  const Case cases[] = {
      {"[ferry]\nroot = \"/x\n", "f.ini:2:", "unterminated quoted value"},
      {"[ferry]\n\nwriters 4\n", "f.ini:3:", "expected key = value"},
      {"[ferry\nwriters = 4\n", "f.ini:1:", "unterminated section header"},
      {"[ferry]\n= 4\n", "f.ini:2:", "missing key"},
      {"[ferry]\nroot = \"/x\" junk\n", "f.ini:2:", "unexpected text after quoted value"},
      {"[ferry]\nroot = \"a\\qb\"\n", "f.ini:2:", "unknown escape"},
      {"; ok\n[ferry.pool]\nsize = 1\n", "f.ini:2:", "nested section [ferry.pool]"},
      {"[x]\nlist = [1,\n2\n", "f.ini:2:", "unterminated list"},
      {"[]\n", "f.ini:1:", "empty section"},
      {"[ferry] x\n", "f.ini:1:", "unexpected text after section header"},
  };
  for (const auto& c : cases) {
    INFO(c.text);
    auto r = ferry::parse_ini_settings(c.text, "f.ini");
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::invalid_argument);
    CHECK(r.status().message().rfind(c.where, 0) == 0);
    CHECK(contains(r.status().message(), c.what));
  }
}

TEST_CASE("INI: a bad value in a file names the file and line", "[options]") {
  auto s = ferry::parse_ini_settings("[ferry]\n\npool-bytes = abc\n", "caf-application.ini");
  REQUIRE(s.ok());
  auto r = ferry::resolve_options(*s);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message().rfind(
            "ferry.pool-bytes = \"abc\" (from caf-application.ini:3): expected a size like 512MiB",
            0) == 0);
}

TEST_CASE("read_ini_settings: a missing file is not_found naming the path", "[options]") {
  ferry::testing::TempDir dir;
  const std::string path = dir.sub("nope.ini");
  auto r = ferry::read_ini_settings(path);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::not_found);
  CHECK(contains(r.status().message(), path));

  write_file(path, "[ferry]\nwriters = 7\n");
  auto ok = ferry::read_ini_settings(path);
  REQUIRE(ok.ok());
  REQUIRE(ok->size() == 1);
  CHECK((*ok)[0].origin == path + ":2");
}

TEST_CASE("load_options: code over FERRY_CONFIG over the config file", "[options]") {
  ferry::testing::TempDir dir;
  REQUIRE(!dir.path().empty());
  const std::string config = dir.sub("app.ini");
  const std::string env_file = dir.sub("env.ini");
  write_file(config,
             "[ferry]\npool-bytes = 2GiB\nwriters = 3\nkeep-last = 1\nroot = /from/config\n");
  write_file(env_file, "[ferry]\nwriters = 4\nkeep-last = 2\n");
  ScopedEnv env("FERRY_CONFIG", env_file.c_str());

  auto r = ferry::load_options({{"keep-last", "5", "code"}}, config);
  REQUIRE(r.ok());
  CHECK(r->pool_bytes == 2ull << 30);  // config file only
  CHECK(r->root == "/from/config");
  CHECK(r->writers == 4);    // FERRY_CONFIG beats the config file
  CHECK(r->keep_last == 5);  // code beats both
  CHECK(r->readers == 0);    // nobody set it: auto

  SECTION("a bad value in FERRY_CONFIG names the variable, the file and the line") {
    write_file(env_file, "[ferry]\n\nreaders = lots\n");
    auto bad = ferry::load_options({}, config);
    REQUIRE_FALSE(bad.ok());
    CHECK(contains(bad.status().message(), "ferry.readers = \"lots\""));
    CHECK(contains(bad.status().message(), "(from FERRY_CONFIG=" + env_file + ":3)"));
  }
}

TEST_CASE("load_options: caf-application.ini in the working directory is optional", "[options]") {
  ferry::testing::TempDir dir;
  REQUIRE(!dir.path().empty());
  ScopedEnv env("FERRY_CONFIG", nullptr);
  ScopedCwd cwd(dir.path());

  auto none = ferry::load_options({}, "");
  REQUIRE(none.ok());
  check_defaults(*none);

  write_file(dir.sub("caf-application.ini"),
             "[scheduler]\nmax-threads = 2\n[ferry]\nwriters = 6\n");
  auto found = ferry::load_options({}, "");
  REQUIRE(found.ok());
  CHECK(found->writers == 6);

  // An explicit --config-file replaces the default file, as in CAF.
  write_file(dir.sub("other.ini"), "[ferry]\nreaders = 9\n");
  auto other = ferry::load_options({}, dir.sub("other.ini"));
  REQUIRE(other.ok());
  CHECK(other->readers == 9);
  CHECK(other->writers == 2);

  write_file(dir.sub("caf-application.ini"), "[ferry]\nwriters = 99\n");
  auto bad = ferry::load_options({}, "");
  REQUIRE_FALSE(bad.ok());
  CHECK(contains(bad.status().message(), "(from caf-application.ini:2)"));
}

TEST_CASE("load_options hands the actor config file's bytes on, so CAF reads no file itself",
          "[options]") {
  ferry::testing::TempDir dir;
  REQUIRE(!dir.path().empty());
  const std::string env_file = dir.sub("env.ini");
  write_file(env_file, "[ferry]\nwriters = 4\n");
  ScopedEnv env("FERRY_CONFIG", env_file.c_str());
  ScopedCwd cwd(dir.path());

  std::string text = "left from before";
  auto none = ferry::load_options({}, "", &text);
  REQUIRE(none.ok());
  CHECK(text.empty());  // no config file: CAF gets nothing, not FERRY_CONFIG's

  const std::string caf_ini = "[scheduler]\nmax-threads = 3\n[ferry]\nwriters = 6\n";
  write_file(dir.sub("caf-application.ini"), caf_ini);
  auto found = ferry::load_options({}, "", &text);
  REQUIRE(found.ok());
  CHECK(text == caf_ini);
  CHECK(found->writers == 4);

  const std::string other_ini = "[middleman]\nenable-automatic-connections = false\n";
  write_file(dir.sub("other.ini"), other_ini);
  auto other = ferry::load_options({}, dir.sub("other.ini"), &text);
  REQUIRE(other.ok());
  CHECK(text == other_ini);
}

TEST_CASE("load_options: a named file that is missing is an error", "[options]") {
  ferry::testing::TempDir dir;
  ScopedEnv env("FERRY_CONFIG", nullptr);
  const std::string missing = dir.sub("missing.ini");

  auto explicit_missing = ferry::load_options({}, missing);
  REQUIRE_FALSE(explicit_missing.ok());
  CHECK(explicit_missing.status().code() == StatusCode::not_found);
  CHECK(contains(explicit_missing.status().message(), missing));

  ScopedEnv env_missing("FERRY_CONFIG", missing.c_str());
  auto env_r = ferry::load_options({}, "");
  REQUIRE_FALSE(env_r.ok());
  CHECK(env_r.status().code() == StatusCode::not_found);
  CHECK(contains(env_r.status().message(), "FERRY_CONFIG"));
  CHECK(contains(env_r.status().message(), missing));
}

TEST_CASE("config/ferry.ini documents every key and parses to the defaults", "[options]") {
  const std::string path = source_dir() + "/config/ferry.ini";
  auto s = ferry::read_ini_settings(path);
  INFO(s.status().to_string());
  REQUIRE(s.ok());

  std::set<std::string> seen;
  for (const auto& setting : *s) {
    INFO(setting.origin);
    CHECK(seen.insert(setting.key).second);
  }
  for (const auto& info : ferry::option_infos()) {
    INFO(info.key);
    CHECK(seen.count(info.key) == 1);
    for (const auto& setting : *s) {
      if (setting.key == info.key) CHECK(setting.value == info.default_value);
    }
  }
  CHECK(seen.size() == ferry::option_infos().size());

  // Each key's comment starts with its help text, so the file and
  // `ferry config` say the same thing. Comment lines are rejoined first.
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string joined;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text.compare(i, 3, "\n; ") == 0) {
      joined += ' ';
      i += 2;
    } else {
      joined += static_cast<char>(std::tolower(static_cast<unsigned char>(text[i])));
    }
  }
  for (const auto& info : ferry::option_infos()) {
    INFO(info.key << ": " << info.help);
    std::string help = info.help;
    for (char& c : help) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    CHECK(contains(joined, help));
  }

  auto r = ferry::resolve_options(*s);
  REQUIRE(r.ok());
  check_defaults(*r);
}

TEST_CASE("a config path that is a FIFO or huge is refused, never read", "[options]") {
  char tmpl[] = "/tmp/ferry-ini-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;
  const std::string fifo = dir + "/fifo.ini";
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  // Opening a FIFO for reading blocks until a writer comes: this returns.
  auto r = ferry::read_ini_settings(fifo);
  REQUIRE_FALSE(r.ok());
  CHECK(contains(r.status().message(), fifo));
  CHECK(contains(r.status().message(), "not a regular file"));

  const std::string big = dir + "/big.ini";
  {
    std::ofstream out(big);
    out << "[ferry]\n";
    out << std::string(20 << 20, ';') << "\n";
  }
  auto b = ferry::read_ini_settings(big);
  REQUIRE_FALSE(b.ok());
  CHECK(contains(b.status().message(), big));
  std::filesystem::remove_all(dir);
}

TEST_CASE("replica-check takes auto, full, sampled or off, and plan-timeout defaults below 60 s",
          "[options]") {
  CHECK(Options{}.replica_check == ferry::ReplicaCheck::automatic);
  // Shorter than the 60 s a save some ranks never call used to wait.
  CHECK(Options{}.plan_timeout_s < 60);
  const std::pair<const char*, ferry::ReplicaCheck> ok[] = {
      {"auto", ferry::ReplicaCheck::automatic},
      {"full", ferry::ReplicaCheck::full},
      {"Sampled", ferry::ReplicaCheck::sampled},
      {"off", ferry::ReplicaCheck::off}};
  for (const auto& [text, mode] : ok) {
    auto r = resolve1("replica-check", text);
    REQUIRE(r.ok());
    CHECK(r->replica_check == mode);
  }
  auto bad = resolve1("replica-check", "some");
  REQUIRE_FALSE(bad.ok());
  CHECK(contains(bad.status().message(), "replica-check"));
  CHECK(contains(bad.status().message(), "expected auto, full, sampled or off"));
}

TEST_CASE("load-sharing takes node (the default) or job, another value is named", "[options]") {
  CHECK_FALSE(Options{}.load_sharing_job);
  auto job = resolve1("load-sharing", "Job");
  REQUIRE(job.ok());
  CHECK(job->load_sharing_job);
  auto node = resolve1("load-sharing", "node");
  REQUIRE(node.ok());
  CHECK_FALSE(node->load_sharing_job);
  auto bad = resolve1("load-sharing", "host");
  REQUIRE_FALSE(bad.ok());
  CHECK(contains(bad.status().message(), "load-sharing"));
  CHECK(contains(bad.status().message(), "expected node or job"));
}

TEST_CASE("direct-lanes takes tcp (the default), shm or off, and lane-info a boolean",
          "[options]") {
  CHECK(Options{}.direct_lanes == "tcp");
  CHECK_FALSE(Options{}.lane_info);
  auto shm = resolve1("direct-lanes", "SHM");
  REQUIRE(shm.ok());
  CHECK(shm->direct_lanes == "shm");
  auto off = ferry::resolve_options({{"direct-lanes", "off", "code"}, {"lane-info", "on", "code"}});
  REQUIRE(off.ok());
  CHECK(off->direct_lanes == "off");
  CHECK(off->lane_info);
  auto bad = resolve1("direct-lanes", "rdma");
  REQUIRE_FALSE(bad.ok());
  CHECK(contains(bad.status().message(), "direct-lanes"));
  CHECK(contains(bad.status().message(), "expected tcp, shm or off"));
}

TEST_CASE("the s3 settings parse into their fields, a bad value is named", "[options]") {
  auto r = ferry::resolve_options({{"s3-endpoint", "http://127.0.0.1:7480", "code"},
                                   {"s3-region", "eu-west-1", "code"},
                                   {"s3-addressing", "Virtual", "code"},
                                   {"s3-parts-in-flight", "3", "code"}});
  REQUIRE(r.ok());
  CHECK(r->s3_parts_in_flight == 3);
  CHECK(r->s3_endpoint == "http://127.0.0.1:7480");
  CHECK(r->s3_region == "eu-west-1");
  CHECK(r->s3_virtual_addressing);
  for (auto [key, value] :
       std::vector<std::pair<std::string, std::string>>{{"s3-endpoint", "127.0.0.1:7480"},
                                                        {"s3-region", "eu west"},
                                                        {"s3-addressing", "dns"},
                                                        {"s3-parts-in-flight", "0"},
                                                        {"s3-parts-in-flight", "65"}}) {
    auto bad = ferry::resolve_options({{key, value, "FERRY_CONFIG=/x.ini:3"}});
    REQUIRE_FALSE(bad.ok());
    CHECK(contains(bad.status().message(), key));
    CHECK(contains(bad.status().message(), value));
  }
}
