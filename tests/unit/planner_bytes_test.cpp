// The public planner's byte forms (LocalSavePlan / SavePlan::to_bytes,
// every rank's plans in PlanReply.allPlans): Cap'n Proto messages of
// schemas/plan.capnp behind a magic, decoded as untrusted input. Round trips,
// then every truncation, random bytes and bit flips: each ends in a plan or
// an error naming what is wrong, never a crash.

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <catch2/catch.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "plan.capnp.h"
#include "planner_api.hpp"

namespace {

using ferry::DType;
using ferry::LocalSavePlan;
using ferry::PlanItem;
using ferry::SavePlan;

// Three ranks: a row-sharded weight, a replicated bias, a 0-d counter, an
// empty tensor, and a bf16 item only rank 2 has.
std::vector<LocalSavePlan> sample_locals() {
  std::vector<LocalSavePlan> out;
  for (int32_t r = 0; r < 3; ++r) {
    LocalSavePlan p;
    p.rank = r;
    p.items.push_back({"layer.weight", DType::f32, {6, 4}, {2 * r, 0}, {2, 4}, 32, 0});
    p.items.push_back({"layer.bias", DType::f32, {4}, {0}, {4}, 16, 1});
    p.items.push_back({"step", DType::i64, {}, {}, {}, 8, 2});
    p.items.push_back({"empty", DType::f16, {0, 3}, {0, 0}, {0, 3}, 0, 3});
    if (r == 2) p.items.push_back({"only \"two\"", DType::bf16, {3, 5}, {0, 0}, {3, 5}, 30, 4});
    out.push_back(std::move(p));
  }
  return out;
}

std::vector<SavePlan> sample_plans() {
  auto g = ferry::plan::global_plan(sample_locals());
  REQUIRE(g.ok());
  return std::move(g).value();
}

// Every input must end in a value or a non-ok Status whose message names
// the kind of bytes; a decoded value must encode and decode to itself.
template <class T>
void check_decodes_or_names(const std::string& bytes, const char* kind) {
  auto r = T::from_bytes(bytes);
  if (!r.ok()) {
    CHECK_THAT(r.status().message(), Catch::StartsWith(kind));
    return;
  }
  const std::string again = r->to_bytes();
  auto back = T::from_bytes(again);
  REQUIRE(back.ok());
  CHECK(back->to_bytes() == again);
}

std::filesystem::path seed_dir() {
  return std::filesystem::path(FERRY_TESTS_DIR) / "fuzz" / "plan";
}

std::vector<std::pair<std::string, std::string>> seeds() {
  const auto plans = sample_plans();
  return {{"local.bin", sample_locals()[2].to_bytes()},
          {"rank.bin", plans[1].to_bytes()},
          {"global.bin", ferry::encode_save_plans(plans)}};
}

}  // namespace

TEST_CASE("plans are Cap'n Proto messages that round trip exactly", "[planner_api][plan_bytes]") {
  const auto locals = sample_locals();
  const auto plans = sample_plans();
  for (const auto& l : locals) {
    const std::string b = l.to_bytes();
    REQUIRE(b.compare(0, 8, "FRYLPLN2") == 0);
    auto back = LocalSavePlan::from_bytes(b);
    REQUIRE(back.ok());
    CHECK(back->to_string() == l.to_string());
    CHECK(back->to_bytes() == b);
  }
  for (const auto& p : plans) {
    const std::string b = p.to_bytes();
    auto back = SavePlan::from_bytes(b);
    REQUIRE(back.ok());
    CHECK(back->to_string() == p.to_string());
    CHECK(back->owners == p.owners);
    CHECK(back->to_bytes() == b);
    // What follows the magic is a schemas/plan.capnp SavePlan, readable by
    // anyone with the schema.
    REQUIRE(b.compare(0, 8, "FRYSPLN2") == 0);
    std::vector<capnp::word> words((b.size() - 8) / sizeof(capnp::word));
    std::memcpy(words.data(), b.data() + 8, b.size() - 8);
    capnp::FlatArrayMessageReader reader(
        kj::ArrayPtr<const capnp::word>(words.data(), words.size()));
    auto root = reader.getRoot<ferry::proto::SavePlan>();
    CHECK(root.getRank() == p.rank);
    CHECK(root.getItems().size() == p.items.size());
    CHECK(root.getWrites().size() == p.writes.size());
    CHECK(root.getBytes() == p.bytes);
  }
  auto all = ferry::decode_save_plans(ferry::encode_save_plans(plans));
  REQUIRE(all.ok());
  REQUIRE(all->size() == plans.size());
  for (size_t r = 0; r < plans.size(); ++r) CHECK((*all)[r].to_bytes() == plans[r].to_bytes());
}

TEST_CASE("plan bytes of the wrong kind, truncated or inconsistent are refused by name",
          "[planner_api][plan_bytes]") {
  const auto plans = sample_plans();
  const std::string local = sample_locals()[0].to_bytes();
  const std::string rank = plans[0].to_bytes();

  auto mixed = SavePlan::from_bytes(local);
  REQUIRE_FALSE(mixed.ok());
  CHECK_THAT(mixed.status().message(),
             Catch::Contains("bytes of a local plan, not of a save plan"));
  auto mixed2 = LocalSavePlan::from_bytes(rank);
  REQUIRE_FALSE(mixed2.ok());
  CHECK_THAT(mixed2.status().message(), Catch::Contains("bytes of a save plan"));
  CHECK_THAT(ferry::decode_save_plans(rank).status().message(),
             Catch::Contains("global plan") && Catch::Contains("bad magic"));

  // A whole word cut off: the message is shorter than its segment table says.
  auto cut = SavePlan::from_bytes(rank.substr(0, rank.size() - 8));
  REQUIRE_FALSE(cut.ok());
  CHECK_THAT(cut.status().message(), Catch::Contains("save plan: truncated"));
  auto odd = LocalSavePlan::from_bytes(local.substr(0, local.size() - 3));
  REQUIRE_FALSE(odd.ok());
  CHECK_THAT(odd.status().message(), Catch::Contains("local plan: truncated"));
  auto extra = LocalSavePlan::from_bytes(local + std::string(8, '\0'));
  REQUIRE_FALSE(extra.ok());
  CHECK_THAT(extra.status().message(), Catch::Contains("8 bytes after the end"));

  // Well-formed Cap'n Proto whose values Ferry cannot use: each names the field.
  auto refused = [](SavePlan p) {
    auto r = SavePlan::from_bytes(p.to_bytes());
    REQUIRE_FALSE(r.ok());
    return r.status().message();
  };
  SavePlan p = plans[2];
  REQUIRE_FALSE(p.writes.empty());
  {
    SavePlan q = p;
    q.writes[0].item = 99;
    CHECK_THAT(refused(q), Catch::Contains("write 0 names item 99"));
  }
  {
    SavePlan q = p;
    q.writes[0].file = 7;
    CHECK_THAT(refused(q), Catch::Contains("write 0 names file 7"));
  }
  {
    SavePlan q = p;
    q.writes[0].sizes[0] += 100;
    CHECK_THAT(refused(q), Catch::Contains("write 0") && Catch::Contains("outside item"));
  }
  {
    SavePlan q = p;
    q.writes[0].nbytes += 1;
    CHECK_THAT(refused(q), Catch::Contains("write 0: nbytes"));
  }
  {
    SavePlan q = p;
    q.bytes += 1;
    CHECK_THAT(refused(q), Catch::Contains("bytes " + std::to_string(p.bytes + 1)));
  }
  {
    // Fewer owner lists than items: to_bytes cannot say that, a hand-built
    // message can.
    capnp::MallocMessageBuilder mb;
    auto root = mb.initRoot<ferry::proto::SavePlan>();
    auto item = root.initItems(1)[0];
    item.setKey("k");
    item.setDtype("F32");
    item.setNbytes(4);
    kj::Array<capnp::word> words = capnp::messageToFlatArray(mb);
    auto r = SavePlan::from_bytes(
        "FRYSPLN2" + std::string(reinterpret_cast<const char*>(words.asBytes().begin()),
                                 words.asBytes().size()));
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status().message(), Catch::Contains("save plan: 0 owner lists for 1 items"));
  }
  {
    SavePlan q = p;
    q.rank = -3;
    CHECK_THAT(refused(q), Catch::Contains("negative rank -3"));
  }
  {
    SavePlan q = p;
    q.files[0] = "../escape";
    CHECK_THAT(refused(q), Catch::Contains("is not a file name"));
  }
  {
    SavePlan q = p;
    q.items[0].global_shape = {6, -4};
    CHECK_THAT(refused(q), Catch::Contains("\"layer.weight\"") && Catch::Contains("negative"));
  }
  {
    // Offsets near INT64_MAX: the region check must not overflow.
    SavePlan q = p;
    q.items[0].offsets = {INT64_MAX - 1, 0};
    CHECK_THAT(refused(q), Catch::Contains("\"layer.weight\"") && Catch::Contains("outside shape"));
  }
  {
    SavePlan q = p;
    q.items[1].dtype = static_cast<DType>(200);
    CHECK_THAT(refused(q), Catch::Contains("item 1 \"layer.bias\""));
  }
  // One bad rank in the global plan names the rank.
  std::vector<SavePlan> bad = plans;
  bad[1].writes.front().item = 50;
  auto list = ferry::decode_save_plans(ferry::encode_save_plans(bad));
  REQUIRE_FALSE(list.ok());
  CHECK_THAT(list.status().message(),
             Catch::Contains("global plan: rank 1's save plan: write 0 names item 50"));
}

TEST_CASE("every truncation, random bytes and bit flips of plan bytes decode or fail cleanly",
          "[planner_api][plan_bytes]") {
  const auto plans = sample_plans();
  const std::string local = sample_locals()[2].to_bytes();
  const std::string rank = plans[2].to_bytes();
  const std::string all = ferry::encode_save_plans(plans);
  for (size_t n = 0; n < local.size(); ++n) {
    auto r = LocalSavePlan::from_bytes(local.substr(0, n));
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status().message(), Catch::StartsWith("local plan: "));
  }
  for (size_t n = 0; n < rank.size(); ++n) {
    auto r = SavePlan::from_bytes(rank.substr(0, n));
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status().message(), Catch::StartsWith("save plan: "));
  }
  for (size_t n = 0; n < all.size(); n += 3) {
    auto r = ferry::decode_save_plans(all.substr(0, n));
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status().message(), Catch::StartsWith("global plan: "));
  }
  std::mt19937_64 rng(20261201);
  size_t decoded = 0;
  for (int i = 0; i < 3000; ++i) {
    // Random words behind the right magic, and valid bytes with a few bits,
    // bytes or words changed.
    std::string junk = i % 2 ? "FRYSPLN2" : "FRYLPLN2";
    const size_t words = rng() % 64;
    for (size_t w = 0; w < words * 8; ++w) junk.push_back(static_cast<char>(rng()));
    check_decodes_or_names<SavePlan>(junk, "save plan: ");
    check_decodes_or_names<LocalSavePlan>(junk, "local plan: ");

    std::string flipped = i % 2 ? rank : local;
    for (int k = 0, flips = 1 + static_cast<int>(rng() % 4); k < flips; ++k) {
      const size_t at = 8 + rng() % (flipped.size() - 8);
      if (rng() % 2)
        flipped[at] = static_cast<char>(flipped[at] ^ (1u << (rng() % 8)));
      else
        flipped[at] = static_cast<char>(rng());
    }
    if (i % 2) {
      check_decodes_or_names<SavePlan>(flipped, "save plan: ");
      decoded += SavePlan::from_bytes(flipped).ok();
    } else {
      check_decodes_or_names<LocalSavePlan>(flipped, "local plan: ");
      decoded += LocalSavePlan::from_bytes(flipped).ok();
    }
    std::string list = all;
    list[8 + rng() % (list.size() - 8)] = static_cast<char>(rng());
    auto l = ferry::decode_save_plans(list);
    if (!l.ok()) CHECK_THAT(l.status().message(), Catch::StartsWith("global plan: "));
  }
  // Flips in key text or unused bits leave a usable plan: the loop reached
  // the checks behind the Cap'n Proto layer, not only its refusals.
  CHECK(decoded > 0);
}

TEST_CASE("the plan fuzz seeds decode", "[planner_api][plan_bytes]") {
  for (const auto& [name, bytes] : seeds()) {
    INFO(name << " (regenerate: ferry_unit_tests \"[write-plan-seeds]\")");
    std::ifstream in(seed_dir() / name, std::ios::binary);
    REQUIRE(in.good());
    const std::string stored((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
    CHECK(stored.size() < 8192);
    if (name == "local.bin") CHECK(LocalSavePlan::from_bytes(stored).ok());
    if (name == "rank.bin") CHECK(SavePlan::from_bytes(stored).ok());
    if (name == "global.bin") CHECK(ferry::decode_save_plans(stored).ok());
  }
}

// Regenerates tests/fuzz/plan/*.bin after a schema change:
//   ferry_unit_tests "[write-plan-seeds]"
TEST_CASE("write the plan fuzz seeds", "[.][write-plan-seeds]") {
  std::filesystem::create_directories(seed_dir());
  for (const auto& [name, bytes] : seeds()) {
    std::ofstream out(seed_dir() / name, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    REQUIRE(out.good());
  }
}
