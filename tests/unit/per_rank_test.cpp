// Per-rank entries (issue 41, 1): one value per rank under one key, stored
// under "<key>@rank<r>", never a replica, and loaded by rank and policy.

#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "commit.hpp"
#include "load_plan.hpp"
#include "manifest.hpp"
#include "plan.hpp"

namespace {

using ferry::DType;
using ferry::OnResize;
using ferry::StateDict;
using ferry::TensorView;

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// The manifest of a save by `world` ranks, each with its own 16-byte "rng"
// (from its local plan, as the coordinator assembles it) and a replicated "w".
ferry::Manifest saved_by(int32_t world) {
  std::vector<ferry::WriteResult> results;
  uint8_t bytes[16] = {};
  float w[4] = {};
  for (int32_t r = 0; r < world; ++r) {
    StateDict sd;
    REQUIRE(sd.add_per_rank("rng", TensorView(bytes, DType::u8, {16})).ok());
    REQUIRE(sd.add("w", TensorView(w, DType::f32, {4})).ok());
    auto plan = ferry::make_local_plan(sd, r);
    REQUIRE(plan.ok());
    ferry::WriteResult wr;
    wr.rank = r;
    wr.files.push_back({"rank-" + std::to_string(r), 16 + 16, 0, 0});
    uint64_t at = 0;
    for (const auto& it : plan->items) {
      if (it.key == "w" && r != 0) continue;  // written once, by rank 0
      ferry::WrittenChunk c;
      c.key = it.key;
      c.dtype = it.dtype;
      c.global_shape = it.global_shape;
      c.box = it.box;
      c.byte_offset = at;
      c.byte_length = it.nbytes;
      c.entry = it.key;
      at += it.nbytes;
      wr.chunks.push_back(c);
    }
    results.push_back(wr);
  }
  ferry::Manifest header;
  header.world_size = world;
  auto m = ferry::assemble_manifest(header, results);
  REQUIRE(m.ok());
  return m.value();
}

}  // namespace

TEST_CASE("per_rank_key names one rank's value, and only that spelling parses back", "[per_rank]") {
  CHECK(ferry::per_rank_key("data.pos", 12) == "data.pos@rank12");
  auto pr = ferry::parse_per_rank_key("data.pos@rank12");
  REQUIRE(pr);
  CHECK(pr->first == "data.pos");
  CHECK(pr->second == 12);
  for (const char* not_one :
       {"rng", "rng@rank", "rng@rank01", "rng@rankx", "@rank3x", "rank3", "rng@rank99999999999"})
    CHECK_FALSE(ferry::parse_per_rank_key(not_one));
}

TEST_CASE("per-rank entries get their rank's key in the local plan, never a replica",
          "[per_rank]") {
  uint8_t a[16] = {1}, b[16] = {2};
  std::vector<ferry::LocalPlan> plans;
  for (int32_t r = 0; r < 2; ++r) {
    StateDict sd;
    REQUIRE(sd.add_per_rank("rng", TensorView(r ? b : a, DType::u8, {16})).ok());
    auto plan = ferry::make_local_plan(sd, r);
    REQUIRE(plan.ok());
    CHECK(plan->items[0].key == "rng@rank" + std::to_string(r));
    plans.push_back(plan.value());
  }
  auto gp = ferry::make_global_plan(plans);
  REQUIRE(gp.ok());
  CHECK(gp->unique_items == 2);  // one per rank, each written by its rank
  for (const auto& rp : gp->ranks) {
    CHECK(rp.chunks.size() == 1);
    CHECK(rp.replicated.empty());  // no replica check across ranks' own values
  }
}

TEST_CASE("an ordinary key in the per-rank form, and a per-rank shard, are refused", "[per_rank]") {
  float w[4] = {};
  StateDict sd;
  REQUIRE(sd.add("w@rank1", TensorView(w, DType::f32, {4})).ok());
  auto plan = ferry::make_local_plan(sd, 0);
  REQUIRE_FALSE(plan.ok());
  CHECK(contains(plan.status().message(), "tensor 'w@rank1'"));
  CHECK(contains(plan.status().message(), "reserved"));

  StateDict sharded;
  REQUIRE(sharded.add_per_rank("rng", TensorView(w, DType::f32, {4})).ok());
  sharded.entries()[0].shard = ferry::Shard{{8}, {0}};
  auto bad = ferry::make_local_plan(sharded, 0);
  REQUIRE_FALSE(bad.ok());
  CHECK(contains(bad.status().message(), "tensor 'rng'"));
  CHECK(contains(bad.status().message(), "per-rank"));
}

TEST_CASE("the manifest records each per-rank value's rank and keeps it through encoding",
          "[per_rank]") {
  const ferry::Manifest m = saved_by(2);
  REQUIRE(m.tensors.size() == 3);
  CHECK(m.find("rng@rank0")->per_rank == 0);
  CHECK(m.find("rng@rank1")->per_rank == 1);
  CHECK(m.find("w")->per_rank == -1);
  auto back = ferry::decode_manifest(ferry::encode_manifest(m));
  REQUIRE(back.ok());
  CHECK(back->find("rng@rank0")->per_rank == 0);
  CHECK(back->find("rng@rank1")->per_rank == 1);
  CHECK(back->find("w")->per_rank == -1);
}

TEST_CASE("a load gives each rank its own value, and across world sizes follows on_resize",
          "[per_rank]") {
  const ferry::Manifest m = saved_by(2);
  uint8_t bytes[16] = {};
  float w[4] = {};
  auto resolve = [&](OnResize policy, int32_t rank, int32_t world, std::string* key) {
    StateDict sd;
    REQUIRE(sd.add("w", TensorView(w, DType::f32, {4})).ok());
    REQUIRE(sd.add_per_rank("rng", TensorView(bytes, DType::u8, {16}), policy).ok());
    auto reqs = ferry::make_load_requests(sd);
    REQUIRE(reqs.ok());
    ferry::Status st = ferry::resolve_per_rank(*reqs, sd, m, rank, world);
    if (st.ok()) {
      *key = (*reqs)[1].key;
      CHECK((*reqs)[0].key == "w");
      // The other ranks' values are not reported as left out.
      CHECK(ferry::tensors_not_requested(m, *reqs).empty());
      CHECK(ferry::make_load_plan(m, *reqs).ok());
    }
    return st;
  };
  std::string key;
  REQUIRE(resolve(OnResize::error, 1, 2, &key).ok());
  CHECK(key == "rng@rank1");
  REQUIRE(resolve(OnResize::first, 0, 2, &key).ok());
  CHECK(key == "rng@rank0");
  for (int32_t world : {3, 1}) {
    ferry::Status st = resolve(OnResize::error, 0, world, &key);
    REQUIRE_FALSE(st.ok());
    CHECK(contains(st.message(), "tensor 'rng' is per-rank: saved by 2 ranks, loaded by " +
                                     std::to_string(world)));
    for (int32_t rank = 0; rank < world; ++rank) {
      REQUIRE(resolve(OnResize::first, rank, world, &key).ok());
      CHECK(key == "rng@rank0");
    }
  }
}
