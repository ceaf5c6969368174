#include "protocol.hpp"

#include <capnp/any.h>
#include <capnp/message.h>
#include <capnp/serialize.h>

#include <catch2/catch.hpp>

#include <limits>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "control.capnp.h"
#include "plan.capnp.h"
#include "test_util.hpp"

namespace {

using namespace ferry;

// --- samples: every message type with contents that exercise each field ----------

Box box(std::vector<int64_t> offsets, std::vector<int64_t> sizes) {
  return Box{std::move(offsets), std::move(sizes)};
}

JoinMsg sample_join() {
  JoinMsg m;
  m.job_id = "job-7f3a";
  m.token = "torchelastic-1234";
  m.rank = 3;
  m.world_size = 8;
  m.host = "node-017.cluster";
  m.pid = 4194301;
  return m;
}

JoinAckMsg sample_join_ack() {
  JoinAckMsg m;
  m.job_id = "job-7f3a";
  m.status = Status::invalid_argument("rank 3: token \"x\" does not match job-7f3a");
  m.clock_ns = -123456789012345;  // another host's steady clock may be far from ours
  return m;
}

// A rank's timeline (trace-dir), as a write result or load outcome carries it.
ferry::RankTrace sample_trace(int32_t rank) {
  ferry::RankTrace t;
  t.rank = rank;
  t.host = "node-017";
  t.clock_error_ns = 41000;
  t.spans = {{"plan", "save", 1000, 2000, 0, -1},
             {"write rank-00002-0000.safetensors", "rank-00002-0000.safetensors", 2500, 9000,
              33558528, -1},
             {"read", "read", -50, 70, 4096, 0.25}};
  return t;
}

HeartbeatMsg sample_heartbeat() {
  HeartbeatMsg m;
  m.job_id = "job-7f3a";
  m.rank = 5;
  m.seq = 0xfedcba9876543210ull;
  return m;
}

AbortMsg sample_abort() {
  AbortMsg m;
  m.job_id = "job-7f3a";
  m.checkpoint_id = "ckpt-000042";
  m.failed_rank = 6;
  m.phase = "write";
  m.reason = Status::io_error("pwrite /ckpt/.pending/rank-00006-0000.safetensors: No space left");
  return m;
}

CommitMsg sample_commit() {
  CommitMsg m;
  m.job_id = "job-7f3a";
  m.checkpoint_id = "ckpt-000042";
  m.status = Status::ok_status();
  m.path = "/ckpt/step-00001000";
  m.commit_seq = 17;
  return m;
}

PlanRequest sample_plan_request() {
  PlanRequest m;
  m.job_id = "job-7f3a";
  m.checkpoint_id = "ckpt-000042";
  m.rank = 2;
  m.step = 1000;
  m.root = "/ckpt";
  m.overwrite = true;
  m.metadata = {{"lr", "3e-4"}, {"note", "ünïcode ok"}, {"", ""}};
  m.files = {"model_v3", 1 << 18, "zstd:3"};
  m.plan.rank = 2;
  WriteItem a;
  a.key = "layer0.weight";
  a.dtype = DType::bf16;
  a.global_shape = {8192, 4096};
  a.box = box({4096, 0}, {4096, 4096});
  a.nbytes = 4096ull * 4096 * 2;
  a.entry = 0;
  WriteItem scalar;  // a 0-d tensor: empty shape and box
  scalar.key = "step";
  scalar.dtype = DType::i64;
  scalar.nbytes = 8;
  scalar.entry = 1;
  WriteItem grid;
  grid.key = "experts.w";
  grid.dtype = DType::f8_e4m3;
  grid.global_shape = {16, 64, 0};
  grid.box = box({8, 32, 0}, {8, 32, 0});
  grid.entry = 2;
  m.plan.items = {a, scalar, grid};
  return m;
}

PlanReply sample_plan_reply() {
  PlanReply m;
  m.job_id = "job-7f3a";
  m.checkpoint_id = "ckpt-000042";
  m.status = Status::ok_status();
  m.pending_dir = "/ckpt/.pending-00001000-job-7f3a-ckpt-000042";
  m.plan.rank = 2;
  m.plan.files = 2;
  m.plan.bytes = 123456789;
  // Two dim-0 slices of item 0, and whole items (no box on the wire),
  // one of them 0-d.
  m.plan.chunks = {{0, false, box({4096, 0}, {2048, 4096}), 0},
                   {0, false, box({6144, 0}, {2048, 4096}), 1},
                   {1, true, Box{}, 1},
                   {2, true, Box{}, 0}};
  return m;
}

CommitRequest sample_commit_request() {
  CommitRequest m;
  m.job_id = "job-7f3a";
  m.checkpoint_id = "ckpt-000042";
  WriteResult& r = m.result;
  r.rank = 2;
  r.files = {{"rank-00002-0000.safetensors", 33558528, 4096, 0x9e3779b97f4a7c15ull},
             {"rank-00002-0001.safetensors", 4104, 4096, 7}};
  WrittenChunk c;
  c.key = "layer0.weight";
  c.dtype = DType::bf16;
  c.global_shape = {8192, 4096};
  c.box = box({4096, 0}, {4096, 4096});
  c.file = 0;
  c.byte_offset = 4096;
  c.byte_length = 33554432;
  c.entry = "layer0.weight@4096,0";
  c.checksums = {1, 0xffffffffffffffffull, 0x0123456789abcdefull};
  WrittenChunk s;
  s.key = "step";
  s.dtype = DType::i64;
  s.file = 1;
  s.byte_offset = 4096;
  s.byte_length = 8;
  s.entry = "step";
  s.codec = "zstd";  // a compressed chunk carries its frames to the coordinator
  s.raw_length = 8;
  s.frame_bytes = 1 << 20;
  s.frame_ends = {8};
  r.chunks = {c, s};
  r.snapshot_ms = 12.5;
  r.write_ms = 2048.25;
  r.bytes = 33554440;
  m.trace = sample_trace(2);
  return m;
}

LoadRequestMsg sample_load_request() {
  LoadRequestMsg m;
  m.job_id = "job-7f3a";
  m.load_id = "load-0007";
  m.rank = 1;
  m.path = "/ckpt/latest";
  return m;
}

LoadReplyMsg sample_load_reply() {
  LoadReplyMsg m;
  m.job_id = "job-7f3a";
  m.load_id = "load-0007";
  m.status = Status::ok_status();
  m.dir = "/ckpt/step-00001000";
  m.manifest = std::string("FERRYMF1\0\0\x01\xff binary manifest bytes", 34);
  return m;
}

// Rank 0's answer after rank 1 found a corrupt block: the error names them.
LoadOutcomeMsg sample_load_outcome() {
  LoadOutcomeMsg m;
  m.job_id = "job-7f3a";
  m.load_id = "load-0007";
  m.rank = 0;
  m.status = Status::corruption(
      "rank 1: checksum mismatch in tensor 'layers.0.w' of file rank-00001-0000.safetensors");
  m.failed_rank = 1;
  m.trace = sample_trace(0);
  return m;
}

// Rank 2 read 64 KiB of a replicated tensor for rank 1.
BlockShareMsg sample_block_share() {
  return BlockShareMsg{"job-7f3a",
                       "load-0007",
                       2,
                       1,
                       3,
                       1 << 20,
                       Status::ok_status(),
                       std::string(64 * 8, '\x5a'),
                       0x9e3779b97f4a7c15ull};
}

// Rank 1 took those bytes; a second ack says it takes no more.
ShareAckMsg sample_share_ack() {
  return ShareAckMsg{"job-7f3a", "load-0007", 1, 2, 512, Status::ok_status()};
}

std::vector<WireMessage> all_samples() {
  return {sample_join(),       sample_join_ack(),       sample_heartbeat(),
          sample_abort(),      sample_commit(),         sample_plan_request(),
          sample_plan_reply(), sample_commit_request(), sample_load_request(),
          sample_load_reply(), sample_load_outcome(),   sample_block_share(),
          sample_share_ack()};
}

// --- field-by-field comparison, so that a dropped field names itself ---------------

void check_same(const Status& a, const Status& b) {
  CHECK(a.code() == b.code());
  CHECK(a.message() == b.message());
}

void check_same(const Box& a, const Box& b) {
  CHECK(a.offsets == b.offsets);
  CHECK(a.sizes == b.sizes);
}

void check_same(const JoinMsg& a, const JoinMsg& b) {
  CHECK(a.job_id == b.job_id);
  CHECK(a.token == b.token);
  CHECK(a.rank == b.rank);
  CHECK(a.world_size == b.world_size);
  CHECK(a.host == b.host);
  CHECK(a.pid == b.pid);
}

void check_same(const JoinAckMsg& a, const JoinAckMsg& b) {
  CHECK(a.job_id == b.job_id);
  check_same(a.status, b.status);
  CHECK(a.clock_ns == b.clock_ns);
}

void check_same(const HeartbeatMsg& a, const HeartbeatMsg& b) {
  CHECK(a.job_id == b.job_id);
  CHECK(a.rank == b.rank);
  CHECK(a.seq == b.seq);
}

void check_same(const AbortMsg& a, const AbortMsg& b) {
  CHECK(a.job_id == b.job_id);
  CHECK(a.checkpoint_id == b.checkpoint_id);
  CHECK(a.failed_rank == b.failed_rank);
  CHECK(a.phase == b.phase);
  check_same(a.reason, b.reason);
}

void check_same(const CommitMsg& a, const CommitMsg& b) {
  CHECK(a.job_id == b.job_id);
  CHECK(a.checkpoint_id == b.checkpoint_id);
  check_same(a.status, b.status);
  CHECK(a.path == b.path);
  CHECK(a.commit_seq == b.commit_seq);
}

void check_same(const PlanRequest& a, const PlanRequest& b) {
  CHECK(a.job_id == b.job_id);
  CHECK(a.checkpoint_id == b.checkpoint_id);
  CHECK(a.rank == b.rank);
  CHECK(a.step == b.step);
  CHECK(a.root == b.root);
  CHECK(a.overwrite == b.overwrite);
  CHECK(a.metadata == b.metadata);
  CHECK(a.files == b.files);
  CHECK(a.plan.rank == b.plan.rank);
  REQUIRE(a.plan.items.size() == b.plan.items.size());
  for (size_t i = 0; i < a.plan.items.size(); ++i) {
    const WriteItem& x = a.plan.items[i];
    const WriteItem& y = b.plan.items[i];
    INFO("item " << i);
    CHECK(x.key == y.key);
    CHECK(x.dtype == y.dtype);
    CHECK(x.global_shape == y.global_shape);
    check_same(x.box, y.box);
    CHECK(x.nbytes == y.nbytes);
    CHECK(x.entry == y.entry);
  }
}

void check_same(const PlanReply& a, const PlanReply& b) {
  CHECK(a.job_id == b.job_id);
  CHECK(a.checkpoint_id == b.checkpoint_id);
  check_same(a.status, b.status);
  CHECK(a.pending_dir == b.pending_dir);
  CHECK(a.plan.rank == b.plan.rank);
  CHECK(a.plan.files == b.plan.files);
  CHECK(a.plan.bytes == b.plan.bytes);
  REQUIRE(a.plan.chunks.size() == b.plan.chunks.size());
  for (size_t i = 0; i < a.plan.chunks.size(); ++i) {
    INFO("chunk " << i);
    CHECK(a.plan.chunks[i].item == b.plan.chunks[i].item);
    CHECK(a.plan.chunks[i].whole == b.plan.chunks[i].whole);
    check_same(a.plan.chunks[i].box, b.plan.chunks[i].box);
    CHECK(a.plan.chunks[i].file == b.plan.chunks[i].file);
  }
}

void check_same(const CommitRequest& a, const CommitRequest& b) {
  CHECK(a.job_id == b.job_id);
  CHECK(a.checkpoint_id == b.checkpoint_id);
  const WriteResult& x = a.result;
  const WriteResult& y = b.result;
  CHECK(x.rank == y.rank);
  CHECK(x.snapshot_ms == y.snapshot_ms);
  CHECK(x.write_ms == y.write_ms);
  CHECK(x.bytes == y.bytes);
  REQUIRE(x.files.size() == y.files.size());
  for (size_t i = 0; i < x.files.size(); ++i) {
    CHECK(x.files[i].name == y.files[i].name);
    CHECK(x.files[i].size == y.files[i].size);
    // Carried for every rank, so a flipped header byte is caught on load
    // whichever rank wrote the file.
    CHECK(x.files[i].header_bytes == y.files[i].header_bytes);
    CHECK(x.files[i].header_checksum == y.files[i].header_checksum);
  }
  REQUIRE(x.chunks.size() == y.chunks.size());
  for (size_t i = 0; i < x.chunks.size(); ++i) {
    const WrittenChunk& p = x.chunks[i];
    const WrittenChunk& q = y.chunks[i];
    INFO("chunk " << i);
    CHECK(p.key == q.key);
    CHECK(p.dtype == q.dtype);
    CHECK(p.global_shape == q.global_shape);
    check_same(p.box, q.box);
    CHECK(p.file == q.file);
    CHECK(p.byte_offset == q.byte_offset);
    CHECK(p.byte_length == q.byte_length);
    CHECK(p.entry == q.entry);
    CHECK(p.checksums == q.checksums);
    CHECK(p.codec == q.codec);
    CHECK(p.raw_length == q.raw_length);
    CHECK(p.frame_bytes == q.frame_bytes);
    CHECK(p.frame_ends == q.frame_ends);
  }
  CHECK(a.trace == b.trace);
}

void check_same(const LoadRequestMsg& a, const LoadRequestMsg& b) {
  CHECK(a.job_id == b.job_id);
  CHECK(a.load_id == b.load_id);
  CHECK(a.rank == b.rank);
  CHECK(a.path == b.path);
}

void check_same(const LoadReplyMsg& a, const LoadReplyMsg& b) {
  CHECK(a.job_id == b.job_id);
  CHECK(a.load_id == b.load_id);
  check_same(a.status, b.status);
  CHECK(a.dir == b.dir);
  CHECK(a.manifest == b.manifest);
}

void check_same(const LoadOutcomeMsg& a, const LoadOutcomeMsg& b) {
  CHECK(a.job_id == b.job_id);
  CHECK(a.load_id == b.load_id);
  CHECK(a.rank == b.rank);
  check_same(a.status, b.status);
  CHECK(a.failed_rank == b.failed_rank);
  CHECK(a.trace == b.trace);
  REQUIRE(a.needs.size() == b.needs.size());
  for (size_t i = 0; i < a.needs.size(); ++i) {
    CHECK(a.needs[i].rank == b.needs[i].rank);
    CHECK(a.needs[i].host == b.needs[i].host);
    REQUIRE(a.needs[i].ranges.size() == b.needs[i].ranges.size());
    for (size_t j = 0; j < a.needs[i].ranges.size(); ++j) {
      const NeededRange& x = a.needs[i].ranges[j];
      const NeededRange& y = b.needs[i].ranges[j];
      CHECK(x.range.file == y.range.file);
      CHECK(x.range.offset == y.range.offset);
      CHECK(x.range.length == y.range.length);
      CHECK(x.region == y.region);
    }
  }
}

void check_same(const BlockShareMsg& a, const BlockShareMsg& b) {
  CHECK(a.job_id == b.job_id);
  CHECK(a.load_id == b.load_id);
  CHECK(a.from == b.from);
  CHECK(a.to == b.to);
  CHECK(a.file == b.file);
  CHECK(a.offset == b.offset);
  check_same(a.status, b.status);
  CHECK(a.data == b.data);
  CHECK(a.checksum == b.checksum);
}

void check_same(const ShareAckMsg& a, const ShareAckMsg& b) {
  CHECK(a.job_id == b.job_id);
  CHECK(a.load_id == b.load_id);
  CHECK(a.from == b.from);
  CHECK(a.to == b.to);
  CHECK(a.bytes == b.bytes);
  check_same(a.status, b.status);
}

void check_same(const WireMessage& a, const WireMessage& b) {
  REQUIRE(a.index() == b.index());
  std::visit(
      [&b](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        check_same(x, std::get<T>(b));
      },
      a);
}

// Encodes m, decodes the bytes and checks that every field came back; the
// decoded message.
WireMessage round_trip(const WireMessage& m) {
  Result<WireMessage> back = decode_message(encode_message(m));
  REQUIRE(back.ok());
  check_same(m, *back);
  return std::move(back).value();
}

// --- raw frames, for what the C++ encoder never produces --------------------------

std::string frame(uint8_t protocol, capnp::MessageBuilder& mb) {
  kj::Array<capnp::word> words = capnp::messageToFlatArray(mb);
  auto bytes = words.asBytes();
  std::string out("FRY1", 4);
  out.push_back(static_cast<char>(protocol));
  out.append(3, '\0');
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((bytes.size() >> (8 * i)) & 0xff));
  out.append(reinterpret_cast<const char*>(bytes.begin()), bytes.size());
  return out;
}

void set_length(std::string& frame_bytes, uint64_t length) {
  for (int i = 0; i < 8; ++i) frame_bytes[8 + i] = static_cast<char>((length >> (8 * i)) & 0xff);
}

std::string error_of(std::string_view bytes) {
  Result<WireMessage> r = decode_message(bytes);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::invalid_argument);
  return r.status().message();
}

std::filesystem::path seed_dir() {
  return std::filesystem::path(FERRY_TESTS_DIR) / "fuzz" / "protocol";
}

const char* seed_name(const WireMessage& m) {
  static const char* const kFiles[] = {"join.bin",       "join_ack.bin",       "heartbeat.bin",
                                       "abort.bin",      "commit.bin",         "plan_request.bin",
                                       "plan_reply.bin", "commit_request.bin", "load_request.bin",
                                       "load_reply.bin", "load_outcome.bin",   "block_share.bin",
                                       "share_ack.bin"};
  return kFiles[m.index()];
}

}  // namespace

TEST_CASE("every message type round trips with its contents", "[protocol]") {
  for (const WireMessage& m : all_samples()) {
    INFO(message_name(m));
    CHECK(encode_message(round_trip(m)) == encode_message(m));
  }
}

TEST_CASE("error statuses of every code round trip", "[protocol]") {
  for (int c = 0; c <= static_cast<int>(StatusCode::internal); ++c) {
    CommitMsg m = sample_commit();
    m.status = Status(static_cast<StatusCode>(c), "code " + std::to_string(c));
    AbortMsg a = sample_abort();
    a.reason = m.status;
    auto cm = decode_message(encode_message(m));
    auto am = decode_message(encode_message(a));
    REQUIRE(cm.ok());
    REQUIRE(am.ok());
    check_same(std::get<CommitMsg>(*cm).status, m.status);
    check_same(std::get<AbortMsg>(*am).reason, m.status);
  }
}

TEST_CASE("empty and default messages round trip", "[protocol]") {
  for (const WireMessage& m : std::vector<WireMessage>{
           JoinMsg{}, JoinAckMsg{}, HeartbeatMsg{}, AbortMsg{}, CommitMsg{}, PlanRequest{},
           PlanReply{}, CommitRequest{}, LoadRequestMsg{}, LoadReplyMsg{}, LoadOutcomeMsg{}}) {
    INFO(message_name(m));
    round_trip(m);
  }
}

TEST_CASE("a frame at an unaligned address decodes", "[protocol]") {
  for (const WireMessage& m : all_samples()) {
    INFO(message_name(m));
    const std::string bytes = encode_message(m);
    for (size_t shift = 1; shift < 8; ++shift) {
      std::vector<char> buf(bytes.size() + shift);
      std::memcpy(buf.data() + shift, bytes.data(), bytes.size());
      const char* p = buf.data() + shift;
      REQUIRE(reinterpret_cast<uintptr_t>(p) % alignof(uint64_t) != 0);
      Result<WireMessage> back = decode_message(std::string_view(p, bytes.size()));
      REQUIRE(back.ok());
      check_same(m, *back);
    }
  }
}

TEST_CASE("every truncation is an error", "[protocol]") {
  for (const WireMessage& m : all_samples()) {
    INFO(message_name(m));
    const std::string bytes = encode_message(m);
    for (size_t n = 0; n < bytes.size(); ++n) {
      INFO("kept " << n << " of " << bytes.size() << " bytes");
      CHECK_FALSE(decode_message(std::string_view(bytes).substr(0, n)).ok());
    }
    // A sender that lies consistently: the header's length matches what is
    // there, but the Cap'n Proto message itself is cut short.
    for (size_t n = 16; n < bytes.size(); n += 8) {
      INFO("payload cut to " << n - 16 << " bytes, length fixed up");
      std::string cut = bytes.substr(0, n);
      set_length(cut, n - 16);
      CHECK_FALSE(decode_message(cut).ok());
    }
  }
}

TEST_CASE("random byte flips never crash the decoder", "[protocol]") {
  std::mt19937_64 rng(20240611);
  size_t decoded = 0, refused = 0;
  for (const WireMessage& m : all_samples()) {
    const std::string bytes = encode_message(m);
    std::uniform_int_distribution<size_t> pos(0, bytes.size() - 1);
    std::uniform_int_distribution<int> byte(0, 255), flips(1, 4);
    for (int iter = 0; iter < 3000; ++iter) {
      std::string b = bytes;
      for (int k = flips(rng); k > 0; --k) b[pos(rng)] = static_cast<char>(byte(rng));
      Result<WireMessage> r = decode_message(b);
      if (r.ok()) {
        ++decoded;
        // Whatever was accepted must be usable: it encodes and decodes again.
        Result<WireMessage> again = decode_message(encode_message(*r));
        INFO(message_name(*r) << ": " << (again.ok() ? "" : again.status().to_string()));
        CHECK(again.ok());
      } else {
        ++refused;
        CHECK(r.status().code() == StatusCode::invalid_argument);
        CHECK_FALSE(r.status().message().empty());
      }
    }
  }
  // Both outcomes must occur, or the test exercises nothing.
  CHECK(decoded > 0);
  CHECK(refused > 0);
}

TEST_CASE("random payloads behind a valid header never crash", "[protocol]") {
  std::mt19937_64 rng(7);
  for (int iter = 0; iter < 5000; ++iter) {
    const size_t words = 1 + rng() % 24;
    std::string payload(words * 8, '\0');
    for (char& c : payload) c = static_cast<char>(rng());
    if (iter % 2 == 0) {
      // A plausible segment table (one segment of the right size) gets the
      // decoder past the first check more often.
      const uint32_t seg = static_cast<uint32_t>(words - 1);
      std::memset(&payload[0], 0, 4);
      std::memcpy(&payload[4], &seg, 4);
    }
    std::string f("FRY1", 4);
    f.push_back(static_cast<char>(iter % 4 == 1 ? 1 : 0));
    f.append(3, '\0');
    f.append(8, '\0');
    set_length(f, payload.size());
    f += payload;
    Result<WireMessage> r = decode_message(f);
    if (!r.ok()) CHECK(r.status().code() == StatusCode::invalid_argument);
  }
}

TEST_CASE("a bad frame header is an error naming the problem", "[protocol]") {
  const std::string good = encode_message(sample_plan_request());
  REQUIRE(decode_message(good).ok());

  SECTION("too short for a header") {
    CHECK_THAT(error_of(good.substr(0, 15)), Catch::Contains("truncated"));
    CHECK_THAT(error_of(""), Catch::Contains("truncated"));
  }
  SECTION("wrong magic") {
    std::string b = good;
    b[0] = 'X';
    CHECK_THAT(error_of(b), Catch::Contains("magic"));
  }
  SECTION("unknown protocol byte") {
    std::string b = good;
    b[4] = 2;
    std::string e = error_of(b);
    CHECK_THAT(e, Catch::Contains("protocol byte 2"));
  }
  SECTION("non-zero reserved bytes") {
    std::string b = good;
    b[6] = 1;
    CHECK_THAT(error_of(b), Catch::Contains("reserved"));
  }
  SECTION("length larger than the bytes sent") {
    std::string b = good;
    set_length(b, good.size() - 16 + 8);
    CHECK_THAT(error_of(b), Catch::Contains("length"));
    set_length(b, ~0ull);
    CHECK_THAT(error_of(b), Catch::Contains("length"));
  }
  SECTION("length smaller than the bytes sent") {
    std::string b = good;
    set_length(b, good.size() - 16 - 8);
    CHECK_THAT(error_of(b), Catch::Contains("length"));
  }
  SECTION("length not a multiple of 8") {
    std::string b = good + "abc";
    set_length(b, good.size() - 16 + 3);
    CHECK_THAT(error_of(b), Catch::Contains("multiple of 8"));
  }
  SECTION("empty payload") {
    std::string b = good.substr(0, 16);
    set_length(b, 0);
    CHECK_THAT(error_of(b), Catch::Contains("length 0"));
  }
  SECTION("trailing words after the message") {
    std::string b = good + std::string(16, '\0');
    set_length(b, good.size() - 16 + 16);
    CHECK_THAT(error_of(b), Catch::Contains("16 trailing bytes"));
  }
  SECTION("a control payload in a plan frame") {
    std::string b = encode_message(sample_heartbeat());
    b[4] = 1;  // a Heartbeat read as a PlanMessage is a PlanRequest with junk
    Result<WireMessage> r = decode_message(b);
    if (!r.ok()) CHECK_THAT(r.status().message(), Catch::Contains("plan message"));
  }
}

TEST_CASE("content that Cap'n Proto accepts but Ferry cannot use is refused", "[protocol]") {
  SECTION("unknown control member") {
    capnp::MallocMessageBuilder mb;
    mb.initRoot<proto::ControlMessage>().initHeartbeat().setJobId("j");
    mb.getRoot<capnp::AnyStruct>().getDataSection()[0] = 9;
    REQUIRE(static_cast<int>(mb.getRoot<proto::ControlMessage>().which()) == 9);
    std::string e = error_of(frame(0, mb));
    CHECK_THAT(e, Catch::Contains("malformed control message") &&
                      Catch::Contains("unknown ControlMessage member 9"));
  }
  SECTION("unknown plan member") {
    capnp::MallocMessageBuilder mb;
    mb.initRoot<proto::PlanMessage>().initLoadRequest().setJobId("j");
    mb.getRoot<capnp::AnyStruct>().getDataSection()[0] = 5;
    CHECK_THAT(error_of(frame(1, mb)), Catch::Contains("unknown PlanMessage member 5"));
  }
  SECTION("unknown status code") {
    capnp::MallocMessageBuilder mb;
    auto s = mb.initRoot<proto::ControlMessage>().initCommit().initStatus();
    s.setCode(static_cast<proto::Status::Code>(12));
    CHECK_THAT(error_of(frame(0, mb)),
               Catch::Contains("Commit status") && Catch::Contains("unknown status code 12"));
  }
  SECTION("unknown dtype name") {
    capnp::MallocMessageBuilder mb;
    auto item = mb.initRoot<proto::PlanMessage>().initPlanRequest().initPlan().initItems(1)[0];
    item.setKey("emb");
    item.setDtype("F99");
    CHECK_THAT(error_of(frame(1, mb)), Catch::Contains("\"emb\"") && Catch::Contains("F99"));
  }
  SECTION("box offsets and sizes of different ranks") {
    PlanReply m = sample_plan_reply();
    m.plan.chunks[1].box.sizes.pop_back();
    CHECK_THAT(error_of(encode_message(m)),
               Catch::Contains("chunk 1") && Catch::Contains("2 offsets but 1 sizes"));
  }
  SECTION("a whole chunk with a box of its own") {
    capnp::MallocMessageBuilder mb;
    auto plan = mb.initRoot<proto::PlanMessage>().initPlanReply().initPlan();
    plan.setFiles(1);
    auto c = plan.initChunks(1)[0];
    c.setWhole(true);
    auto b = c.initBox();
    b.initOffsets(1).set(0, 0);
    b.initSizes(1).set(0, 4);
    CHECK_THAT(error_of(frame(1, mb)),
               Catch::Contains("chunk 0") && Catch::Contains("whole chunk with a box"));
    // An empty box next to `whole` says nothing more: accepted.
    c.initBox();
    Result<WireMessage> ok = decode_message(frame(1, mb));
    REQUIRE(ok.ok());
    CHECK(std::get<PlanReply>(*ok).plan.chunks[0].whole);
  }
  SECTION("box rank differs from the global shape's") {
    PlanRequest m = sample_plan_request();
    m.plan.items[0].global_shape = {8192};
    CHECK_THAT(error_of(encode_message(m)),
               Catch::Contains("layer0.weight") && Catch::Contains("rank 2"));
  }
  SECTION("a header larger than its file") {
    CommitRequest m = sample_commit_request();
    m.result.files[1].header_bytes = 5000;
    CHECK_THAT(error_of(encode_message(m)), Catch::Contains("rank-00002-0001.safetensors") &&
                                                Catch::Contains("5000-byte header"));
  }
  SECTION("negative size") {
    CommitRequest m = sample_commit_request();
    m.result.chunks[0].box.sizes[1] = -1;
    CHECK_THAT(error_of(encode_message(m)),
               Catch::Contains("layer0.weight") && Catch::Contains("negative"));
  }
  SECTION("a file prefix that leaves the checkpoint directory, an unknown codec") {
    PlanRequest m = sample_plan_request();
    m.files.prefix = "../x";
    CHECK_THAT(error_of(encode_message(m)), Catch::Contains("PlanRequest file prefix"));
    m = sample_plan_request();
    m.files.compress = "lz4";
    CHECK_THAT(error_of(encode_message(m)), Catch::Contains("PlanRequest compress"));
  }
  SECTION("negative global shape") {
    PlanRequest m = sample_plan_request();
    m.plan.items[0].global_shape[1] = -4096;
    CHECK_THAT(error_of(encode_message(m)), Catch::Contains("negative global shape"));
  }
  SECTION("box outside the global shape, even where offset + size overflows") {
    PlanRequest m = sample_plan_request();
    m.plan.items[0].box.offsets[0] = INT64_MAX;
    CHECK_THAT(error_of(encode_message(m)), Catch::Contains("exceeds the global shape"));
  }
  SECTION("a tensor too large to address") {
    PlanRequest m = sample_plan_request();
    m.plan.items[0].global_shape = {INT64_MAX / 2, 4096};
    CHECK_THAT(error_of(encode_message(m)), Catch::Contains("too large"));
  }
  SECTION("chunk file index out of range") {
    CommitRequest m = sample_commit_request();
    m.result.chunks[1].file = 2;
    CHECK_THAT(error_of(encode_message(m)), Catch::Contains("file 2"));
    PlanReply p = sample_plan_reply();
    p.plan.files = 1;
    CHECK_THAT(error_of(encode_message(p)), Catch::Contains("chunk 1: file 1"));
  }
  SECTION("ranks out of range") {
    JoinMsg j = sample_join();
    j.rank = 8;
    CHECK_THAT(error_of(encode_message(j)), Catch::Contains("rank 8 outside world size 8"));
    HeartbeatMsg h = sample_heartbeat();
    h.rank = -2;
    CHECK_THAT(error_of(encode_message(h)), Catch::Contains("negative rank -2"));
    AbortMsg a = sample_abort();
    a.failed_rank = -1;  // "unknown" is allowed
    CHECK(decode_message(encode_message(a)).ok());
  }
  SECTION("text that is not NUL-terminated") {
    std::string b = encode_message(sample_load_request());
    const std::string path = "/ckpt/latest";
    const size_t at = b.find(path);
    REQUIRE(at != std::string::npos);
    b[at + path.size()] = 'x';  // the terminator
    CHECK_THAT(error_of(b), Catch::Contains("malformed plan message"));
  }
}

TEST_CASE("4096-rank-sized plans and write results round trip", "[protocol]") {
  constexpr size_t kChunks = 100000;

  SECTION("PlanReply with 100k chunks") {
    PlanReply m = sample_plan_reply();
    m.plan.files = 4;
    m.plan.chunks.resize(kChunks);
    // Mostly whole chunks, as at scale, with a slice every tenth.
    for (size_t i = 0; i < kChunks; ++i) {
      const bool whole = i % 10 != 9;
      m.plan.chunks[i] = {static_cast<uint32_t>(i), whole,
                          whole ? Box{} : box({int64_t(i) * 64, 0, 0}, {64, 128, 3}),
                          static_cast<uint32_t>(i % 4)};
    }
    const std::string bytes = encode_message(m);
    Result<WireMessage> back = decode_message(bytes);
    REQUIRE(back.ok());
    const auto& r = std::get<PlanReply>(*back);
    REQUIRE(r.plan.chunks.size() == kChunks);
    CHECK(r.plan.chunks.back().box == m.plan.chunks.back().box);
    CHECK_FALSE(r.plan.chunks.back().whole);
    CHECK(r.plan.chunks.back().file == 3);
    CHECK(r.plan.chunks[kChunks - 2].whole);
    CHECK(r.plan.chunks[kChunks - 2].box.offsets.empty());
    CHECK(r.plan.chunks[kChunks - 2].file == 2);
    CHECK(encode_message(*back) == bytes);
  }

  SECTION("CommitRequest larger than Cap'n Proto's 64 MiB default limit") {
    CommitRequest m;
    m.job_id = "job";
    m.checkpoint_id = "ckpt";
    m.result.rank = 4095;
    m.result.files = {{"rank-04095-0000.safetensors", 1ull << 40}};
    m.result.chunks.resize(kChunks);
    std::vector<uint64_t> sums(96);
    for (size_t k = 0; k < sums.size(); ++k) sums[k] = k * 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < kChunks; ++i) {
      WrittenChunk& c = m.result.chunks[i];
      c.key = "model.layers." + std::to_string(i) + ".mlp.weight";
      c.dtype = DType::bf16;
      c.global_shape = {int64_t(kChunks) * 16, 4096};
      c.box = box({int64_t(i) * 16, 0}, {16, 4096});
      c.byte_offset = i * 131072;
      c.byte_length = 131072;
      c.entry = c.key + "@" + std::to_string(i * 16) + ",0";
      c.checksums = sums;
    }
    const std::string bytes = encode_message(m);
    REQUIRE(bytes.size() > (64ull << 20));
    Result<WireMessage> back = decode_message(bytes);
    REQUIRE(back.ok());
    const auto& r = std::get<CommitRequest>(*back).result;
    REQUIRE(r.chunks.size() == kChunks);
    CHECK(r.chunks[54321].key == m.result.chunks[54321].key);
    CHECK(r.chunks[54321].entry == m.result.chunks[54321].entry);
    CHECK(r.chunks.back().checksums == sums);
    CHECK(r.chunks.back().box == m.result.chunks.back().box);
  }
}

TEST_CASE("job id, checkpoint id and name of every message", "[protocol]") {
  const std::vector<WireMessage> all = all_samples();
  const char* const names[] = {"Join",        "JoinAck",     "Heartbeat",   "Abort",
                               "Commit",      "PlanRequest", "PlanReply",   "CommitRequest",
                               "LoadRequest", "LoadReply",   "LoadOutcome", "BlockShare",
                               "ShareAck"};
  const char* const ids[] = {"",
                             "",
                             "",
                             "ckpt-000042",
                             "ckpt-000042",
                             "ckpt-000042",
                             "ckpt-000042",
                             "ckpt-000042",
                             "load-0007",
                             "load-0007",
                             "load-0007",
                             "load-0007",
                             "load-0007"};
  REQUIRE(all.size() == 13);
  for (size_t i = 0; i < all.size(); ++i) {
    CHECK(std::string(message_name(all[i])) == names[i]);
    CHECK(message_job_id(all[i]) == "job-7f3a");
    CHECK(message_checkpoint_id(all[i]) == ids[i]);
  }
}

TEST_CASE("the protocol fuzz seeds decode", "[protocol]") {
  const std::filesystem::path dir = seed_dir();
  if (!std::filesystem::is_directory(dir)) {
    FERRY_SKIP("no seed directory " << dir.string());
  }
  size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() != ".bin") continue;
    std::ifstream in(e.path(), std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    INFO(e.path().string());
    CHECK(bytes.size() < 4096);
    CHECK(decode_message(bytes).ok());
    ++n;
  }
  CHECK(n >= 5);
}

// Regenerates tests/fuzz/protocol/*.bin after a schema change:
//   ferry_unit_tests "[write-seeds]"
TEST_CASE("write the protocol fuzz seeds", "[.][write-seeds]") {
  const std::filesystem::path dir = seed_dir();
  std::filesystem::create_directories(dir);
  for (const WireMessage& m : all_samples()) {
    std::ofstream out(dir / seed_name(m), std::ios::binary | std::ios::trunc);
    const std::string bytes = encode_message(m);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    REQUIRE(out.good());
  }
}

TEST_CASE("Commit carries the slowest rank, write results their ready time", "[protocol]") {
  ferry::CommitMsg c{"job", "ck", ferry::Status(), "/r/step-00000001", 9, 3, 1234.5};
  auto back = ferry::decode_message(ferry::encode_message(c));
  REQUIRE(back.ok());
  const auto& d = std::get<ferry::CommitMsg>(*back);
  CHECK(d.slowest_rank == 3);
  CHECK(d.slowest_ms == 1234.5);
  ferry::CommitRequest req;
  req.job_id = "job";
  req.checkpoint_id = "ck";
  req.result.rank = 2;
  req.result.ready_ms = 77.25;
  auto r = ferry::decode_message(ferry::encode_message(req));
  REQUIRE(r.ok());
  CHECK(std::get<ferry::CommitRequest>(*r).result.ready_ms == 77.25);
}

TEST_CASE("LoadOutcome: reports and answers round trip, bad ranks are refused", "[protocol]") {
  const LoadOutcomeMsg report{"job", "load-3", 2, Status::ok_status(), -1};
  CHECK(message_checkpoint_id(round_trip(report)) == "load-3");

  SECTION("a negative sender rank") {
    capnp::MallocMessageBuilder mb;
    auto o = mb.initRoot<proto::ControlMessage>().initLoadOutcome();
    o.setJobId("j");
    o.setRank(-4);
    CHECK_THAT(error_of(frame(0, mb)),
               Catch::Contains("LoadOutcome") && Catch::Contains("negative rank -4"));
  }
  SECTION("a failed rank below -1") {
    capnp::MallocMessageBuilder mb;
    auto o = mb.initRoot<proto::ControlMessage>().initLoadOutcome();
    o.setFailedRank(-2);
    CHECK_THAT(error_of(frame(0, mb)),
               Catch::Contains("LoadOutcome") && Catch::Contains("failed rank -2"));
  }
  SECTION("an unknown status code") {
    capnp::MallocMessageBuilder mb;
    mb.initRoot<proto::ControlMessage>().initLoadOutcome().initStatus().setCode(
        static_cast<proto::Status::Code>(40));
    CHECK_THAT(error_of(frame(0, mb)),
               Catch::Contains("LoadOutcome status") && Catch::Contains("unknown status code 40"));
  }
  SECTION("an absent status reads as ok, as in every other message") {
    capnp::MallocMessageBuilder mb;
    mb.initRoot<proto::ControlMessage>().initLoadOutcome().setLoadId("load-9");
    auto r = decode_message(frame(0, mb));
    REQUIRE(r.ok());
    CHECK(std::get<LoadOutcomeMsg>(*r).status.ok());
    CHECK(std::get<LoadOutcomeMsg>(*r).failed_rank == -1);
  }
}

TEST_CASE("LoadOutcome carries the ranks' needs, BlockShare its bytes", "[protocol]") {
  LoadOutcomeMsg needs{"job", "load-3/needs", 0, Status::ok_status(), -1};
  needs.needs = {
      {0, "node-a", {{{0, 4096, 1 << 20}, {{0, 512}, {64, 512}}}, {{2, 0, 17}, {{}, {}}}}, {}},
      {3, "node-b", {}, {}}};
  round_trip(needs);

  BlockShareMsg share{
      "job", "load-3", 2, 1, 4, 65536, Status::ok_status(), std::string("\0\x01 bytes\xff", 9), 77};
  const WireMessage back = round_trip(share);
  CHECK(std::string(message_name(back)) == "BlockShare");
  CHECK(message_checkpoint_id(back) == "load-3");

  SECTION("a negative receiver") {
    capnp::MallocMessageBuilder mb;
    mb.initRoot<proto::ControlMessage>().initBlockShare().setTo(-1);
    CHECK_THAT(error_of(frame(0, mb)), Catch::Contains("BlockShare receiver"));
  }
  SECTION("a needs range that overflows") {
    capnp::MallocMessageBuilder mb;
    auto n = mb.initRoot<proto::ControlMessage>().initLoadOutcome().initNeeds(1)[0];
    auto r = n.initRanges(1)[0];
    r.setOffset(~uint64_t{0});
    r.setLength(2);
    CHECK_THAT(error_of(frame(0, mb)), Catch::Contains("overflows"));
  }
  SECTION("a needs region whose end overflows") {
    capnp::MallocMessageBuilder mb;
    auto n = mb.initRoot<proto::ControlMessage>().initLoadOutcome().initNeeds(1)[0];
    n.setRank(5);
    auto r = n.initRanges(1)[0];
    r.setLength(4096);
    r.initRegionOffsets(2).set(1, std::numeric_limits<int64_t>::max() - 3);
    auto sizes = r.initRegionSizes(2);
    sizes.set(0, 1);
    sizes.set(1, 8);
    CHECK_THAT(error_of(frame(0, mb)),
               Catch::Contains("needs of rank 5") && Catch::Contains("region dim 1 overflows"));
  }
  SECTION("a needs region with more sizes than offsets") {
    capnp::MallocMessageBuilder mb;
    auto n = mb.initRoot<proto::ControlMessage>().initLoadOutcome().initNeeds(1)[0];
    auto r = n.initRanges(1)[0];
    r.initRegionSizes(1).set(0, 3);
    CHECK_THAT(error_of(frame(0, mb)), Catch::Contains("0 offsets but 1 sizes"));
  }
}

TEST_CASE("BlockShare data is read where its frame holds it, and encodes from a view",
          "[protocol]") {
  // A staging block's bytes: whole words at a word boundary (referenced, not
  // copied, by the encoder), and an odd tail one byte past it (copied).
  std::vector<uint64_t> block(1 << 14);
  for (size_t i = 0; i < block.size(); ++i) block[i] = i * 0x9e3779b97f4a7c15ull;
  const char* bytes = reinterpret_cast<const char*>(block.data());
  for (const std::string_view view :
       {std::string_view(bytes, block.size() * 8), std::string_view(bytes + 1, 4093)}) {
    BlockShareMsg share{
        "job", "load-9", 2, 1, 0, 4096, Status::ok_status(), SharedBytes(nullptr, view)};
    auto frame = std::make_shared<const std::string>(encode_message(share));
    CHECK(frame->size() >= view.size());
    // No data at a word boundary (a failed reader's report) decodes too.
    BlockShareMsg report = share;
    report.data = SharedBytes(nullptr, view.substr(0, 0));
    CHECK(decode_message(encode_message(report)).ok());
    Result<WireMessage> back = decode_message(frame);
    REQUIRE(back.ok());
    const auto& got = std::get<BlockShareMsg>(*back);
    CHECK(got.data.view() == view);
    // In place: the data lies inside the frame, which it keeps alive.
    CHECK(got.data.data() >= frame->data());
    CHECK(got.data.data() + got.data.size() <= frame->data() + frame->size());
    const std::weak_ptr<const std::string> held = frame;
    const BlockShareMsg kept = got;
    back = Status::internal("dropped");
    frame.reset();
    CHECK_FALSE(held.expired());
    CHECK(kept.data.view() == view);
    // From a plain view the decoder copies: the data outlives the bytes.
    std::string raw = encode_message(share);
    Result<WireMessage> copied = decode_message(std::string_view(raw));
    REQUIRE(copied.ok());
    const char* at = std::get<BlockShareMsg>(*copied).data.data();
    CHECK((at < raw.data() || at >= raw.data() + raw.size()));
    raw.assign(raw.size(), '\0');
    CHECK(std::get<BlockShareMsg>(*copied).data.view() == view);
  }
}

TEST_CASE("A gathered BlockShare carries its parts one after another", "[protocol]") {
  // Columns of a row-major block: every row's stretch, apart in the buffer.
  std::vector<uint64_t> block(1 << 12);
  for (size_t i = 0; i < block.size(); ++i) block[i] = i * 0xc2b2ae3d27d4eb4full + 7;
  const char* bytes = reinterpret_cast<const char*>(block.data());
  struct Case {
    size_t start, width, stride, rows;
  };
  // Whole words from a word boundary (written into the frame from the parts)
  // and stretches that start off a word or end in an odd tail (copied into
  // the message first): both must carry the same stream.
  for (const Case c : {Case{256, 512, 2048, 12}, Case{260, 512, 2048, 12}, Case{256, 300, 2048, 5},
                       Case{8, 24, 24, 1}}) {
    std::vector<std::string_view> parts;
    std::string expect;
    for (size_t r = 0; r < c.rows; ++r) {
      parts.emplace_back(bytes + c.start + r * c.stride, c.width);
      expect.append(parts.back());
    }
    INFO("start " << c.start << " width " << c.width << " rows " << c.rows);
    BlockShareMsg share{"job", "load-4", 0, 1, 3, 1 << 20, Status::ok_status(), {}, 99};
    auto frame = std::make_shared<const std::string>(encode_gathered(share, parts));
    Result<WireMessage> back = decode_message(frame);
    REQUIRE(back.ok());
    const auto& got = std::get<BlockShareMsg>(*back);
    CHECK(got.data.view() == expect);
    CHECK(got.file == 3);
    CHECK(got.offset == 1u << 20);
    CHECK(got.checksum == 99);
    CHECK(got.from == 0);
    CHECK(got.to == 1);
  }
  // No parts: a frame with no data, as a failed reader's report.
  BlockShareMsg none{"job", "load-4", 0, 1, 0, 0, Status::io_error("disk"), {}, 0};
  Result<WireMessage> back = decode_message(encode_gathered(none, {}));
  REQUIRE(back.ok());
  CHECK(std::get<BlockShareMsg>(*back).data.empty());
  CHECK(std::get<BlockShareMsg>(*back).status.code() == StatusCode::io_error);
}

TEST_CASE("ShareAck round trips, bad ranks are refused, not trusted", "[protocol]") {
  ShareAckMsg ack{"job", "load-3", 1, 2, 8 << 20, Status::ok_status()};
  const WireMessage back = round_trip(ack);
  CHECK(std::string(message_name(back)) == "ShareAck");
  CHECK(message_checkpoint_id(back) == "load-3");

  // A receiver that gives up says why; the sender stops with that reason.
  ack.bytes = 0;
  ack.status = Status::timeout("rank 1: no bytes from rank(s) 2 within write-timeout");
  round_trip(ack);

  SECTION("a negative receiver") {
    capnp::MallocMessageBuilder mb;
    mb.initRoot<proto::ControlMessage>().initShareAck().setFrom(-3);
    CHECK_THAT(error_of(frame(0, mb)), Catch::Contains("ShareAck receiver"));
  }
  SECTION("a negative sender") {
    capnp::MallocMessageBuilder mb;
    mb.initRoot<proto::ControlMessage>().initShareAck().setTo(-1);
    CHECK_THAT(error_of(frame(0, mb)), Catch::Contains("ShareAck sender"));
  }
  SECTION("a status code this build does not know") {
    capnp::MallocMessageBuilder mb;
    auto a = mb.initRoot<proto::ControlMessage>().initShareAck();
    a.initStatus().setCode(static_cast<proto::Status::Code>(77));
    CHECK_THAT(error_of(frame(0, mb)), Catch::Contains("ShareAck status"));
  }
  SECTION("every truncation of a valid frame is an error, never a crash") {
    const std::string bytes = encode_message(WireMessage(ack));
    for (size_t n = 0; n < bytes.size(); ++n) CHECK_FALSE(decode_message(bytes.substr(0, n)).ok());
  }
}
