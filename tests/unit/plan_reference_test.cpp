// The optimized global planner against a plain reference, on thousands of
// random inputs: replicas, splits, uneven and empty shards, 0-d to 3-d
// tensors, both owner policies, and broken inputs (gaps, overlaps, dtype and
// shape disagreements). The reference is written for obviousness (pairwise
// overlap checks, element counting), not speed.

#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "plan.hpp"
#include "planner_api.hpp"

namespace {

using ferry::Box;
using ferry::DType;
using ferry::GlobalPlan;
using ferry::GlobalPlanOptions;
using ferry::LocalPlan;
using ferry::OwnerPolicy;
using ferry::WriteItem;
using Dims = std::vector<int64_t>;

int64_t numel(const Dims& d) {
  int64_t n = 1;
  for (int64_t x : d) n *= x;
  return n;
}

bool overlap(const Box& a, const Box& b) {
  for (size_t d = 0; d < a.sizes.size(); ++d) {
    if (a.offsets[d] + a.sizes[d] <= b.offsets[d] || b.offsets[d] + b.sizes[d] <= a.offsets[d])
      return false;
  }
  return numel(a.sizes) > 0 && numel(b.sizes) > 0;
}

bool inside(const Box& inner, const Box& outer) {
  for (size_t d = 0; d < inner.sizes.size(); ++d) {
    if (inner.offsets[d] < outer.offsets[d] ||
        inner.offsets[d] + inner.sizes[d] > outer.offsets[d] + outer.sizes[d])
      return false;
  }
  return true;
}

// One tensor as the ranks hold it: distinct pieces, each held by a set of
// ranks (a piece held by several ranks is a replica group).
struct Piece {
  Box box;
  std::vector<int32_t> holders;
};

struct Tensor {
  std::string key;
  DType dtype = DType::f32;
  Dims shape;
  std::vector<Piece> pieces;
};

const DType kDtypes[] = {DType::f32, DType::bf16, DType::i64,
                         DType::u8,  DType::f64,  DType::boolean};

// Cuts [0, n) into k contiguous, possibly empty, uneven ranges.
std::vector<std::pair<int64_t, int64_t>> cut(int64_t n, int k, std::mt19937_64& rng) {
  std::vector<int64_t> points{0, n};
  for (int i = 1; i < k; ++i) points.push_back(std::uniform_int_distribution<int64_t>(0, n)(rng));
  std::sort(points.begin(), points.end());
  std::vector<std::pair<int64_t, int64_t>> out;
  for (size_t i = 0; i + 1 < points.size(); ++i) out.push_back({points[i], points[i + 1]});
  return out;
}

Tensor random_tensor(const std::string& key, int world, std::mt19937_64& rng) {
  Tensor t;
  t.key = key;
  t.dtype = kDtypes[rng() % std::size(kDtypes)];
  const int ndim = static_cast<int>(rng() % 4);
  for (int d = 0; d < ndim; ++d)
    t.shape.push_back(rng() % 10 == 0 ? 0 : std::uniform_int_distribution<int64_t>(1, 40)(rng));
  // A grid of uneven cuts along up to two dims, at most one cell per rank (a
  // rank lists each key once); each cell goes to one rank, sometimes more
  // (replicas), and ranks left over hold nothing of this tensor.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> cuts;
  int cells = 1;
  for (int d = 0; d < ndim; ++d) {
    const int most = d < 2 ? std::min(4, world / cells) : 1;
    const int k = std::uniform_int_distribution<int>(1, std::max(1, most))(rng);
    cells *= k;
    cuts.push_back(cut(t.shape[d], k, rng));
  }
  std::vector<int32_t> ranks(world);
  for (int r = 0; r < world; ++r) ranks[r] = r;
  std::shuffle(ranks.begin(), ranks.end(), rng);
  size_t next_rank = 0;
  std::vector<size_t> idx(ndim, 0);
  while (true) {
    Piece p;
    for (int d = 0; d < ndim; ++d) {
      p.box.offsets.push_back(cuts[d][idx[d]].first);
      p.box.sizes.push_back(cuts[d][idx[d]].second - cuts[d][idx[d]].first);
    }
    p.holders.push_back(ranks[next_rank++]);
    t.pieces.push_back(std::move(p));
    int d = ndim - 1;
    while (d >= 0 && ++idx[d] == cuts[d].size()) idx[d--] = 0;
    if (d < 0) break;
  }
  while (next_rank < ranks.size() && rng() % 2 == 0)
    t.pieces[rng() % t.pieces.size()].holders.push_back(ranks[next_rank++]);
  for (Piece& p : t.pieces) std::sort(p.holders.begin(), p.holders.end());
  return t;
}

enum class Breakage { none, gap, overlap, dtype, shape };

// Breaks a tensor so that a correct planner must refuse it. Returns false
// when this tensor cannot be broken that way (e.g. no elements to leave out).
bool brk(Tensor* t, Breakage b, int world, std::mt19937_64& rng) {
  switch (b) {
    case Breakage::none:
      return true;
    case Breakage::gap: {
      // Drop a non-empty piece, keeping at least one.
      std::vector<size_t> nonempty;
      for (size_t i = 0; i < t->pieces.size(); ++i)
        if (numel(t->pieces[i].box.sizes) > 0) nonempty.push_back(i);
      if (nonempty.size() < 2) return false;
      t->pieces.erase(t->pieces.begin() + nonempty[rng() % nonempty.size()]);
      return true;
    }
    case Breakage::overlap: {
      // A second, different box that shares elements with a piece.
      for (const Piece& p : t->pieces) {
        if (numel(p.box.sizes) == 0 || p.box.sizes.empty()) continue;
        Piece q = p;
        if (q.box.sizes[0] >= 2) {
          q.box.sizes[0] -= 1;  // a strict sub-box: overlapping, not identical
        } else if (q.box.offsets[0] + q.box.sizes[0] < t->shape[0]) {
          q.box.sizes[0] += 1;
        } else {
          continue;
        }
        q.holders = {static_cast<int32_t>(rng() % world)};
        t->pieces.push_back(q);
        return true;
      }
      return false;
    }
    case Breakage::dtype:
    case Breakage::shape:
      // Applied per item when the plans are built (one holder disagrees).
      return t->pieces.size() > 1 || t->pieces[0].holders.size() > 1;
  }
  return false;
}

std::vector<LocalPlan> to_plans(const std::vector<Tensor>& ts, int world,
                                const std::map<std::string, Breakage>& broken) {
  std::vector<LocalPlan> plans(world);
  for (int r = 0; r < world; ++r) plans[r].rank = r;
  for (const Tensor& t : ts) {
    bool disagreed = false;
    for (const Piece& p : t.pieces) {
      for (int32_t r : p.holders) {
        WriteItem w;
        w.key = t.key;
        w.dtype = t.dtype;
        w.global_shape = t.shape;
        w.box = p.box;
        auto b = broken.find(t.key);
        // The last holder of the last piece disagrees with everyone else.
        const bool last = &p == &t.pieces.back() && r == p.holders.back();
        if (b != broken.end() && last && !disagreed) {
          if (b->second == Breakage::dtype)
            w.dtype = w.dtype == DType::f32 ? DType::i32 : DType::f32;
          if (b->second == Breakage::shape) {
            w.global_shape.push_back(1);
            w.box.offsets.push_back(0);
            w.box.sizes.push_back(1);
          }
          disagreed = b->second == Breakage::dtype || b->second == Breakage::shape;
        }
        w.nbytes = static_cast<uint64_t>(numel(w.box.sizes)) * ferry::dtype_size(w.dtype);
        w.entry = static_cast<uint32_t>(plans[r].items.size());
        plans[r].items.push_back(std::move(w));
      }
    }
  }
  return plans;
}

// The reference validation: true when the plans describe every tensor
// exactly once (identical boxes are replicas).
bool reference_valid(const std::vector<LocalPlan>& plans) {
  std::map<std::string, std::vector<const WriteItem*>> by_key;
  for (const auto& p : plans) {
    std::set<std::string> keys;
    for (const auto& it : p.items) {
      if (!keys.insert(it.key).second) return false;  // a rank lists a key twice
      by_key[it.key].push_back(&it);
    }
  }
  for (const auto& [key, items] : by_key) {
    for (const WriteItem* it : items)
      if (it->dtype != items[0]->dtype || it->global_shape != items[0]->global_shape) return false;
    std::vector<Box> distinct;
    for (const WriteItem* it : items) {
      bool seen = false;
      for (const Box& b : distinct)
        seen = seen || (b.offsets == it->box.offsets && b.sizes == it->box.sizes);
      if (!seen) distinct.push_back(it->box);
    }
    int64_t covered = 0;
    for (size_t i = 0; i < distinct.size(); ++i) {
      for (size_t j = i + 1; j < distinct.size(); ++j)
        if (overlap(distinct[i], distinct[j])) return false;
      covered += numel(distinct[i].sizes);
    }
    if (covered != numel(items[0]->global_shape)) return false;
  }
  return true;
}

// Checks every property a valid plan must have against the inputs.
void check_plan(const std::vector<LocalPlan>& plans, const GlobalPlan& gp,
                const GlobalPlanOptions& opts) {
  REQUIRE(gp.ranks.size() == plans.size());
  // Per key: the chunks written, as (writer rank, box).
  std::map<std::string, std::vector<std::pair<int32_t, Box>>> written;
  std::vector<uint64_t> load(plans.size(), 0);
  for (size_t r = 0; r < gp.ranks.size(); ++r) {
    const auto& rp = gp.ranks[r];
    REQUIRE(rp.rank == static_cast<int32_t>(r));
    uint64_t bytes = 0;
    for (const auto& a : rp.chunks) {
      REQUIRE(a.item < plans[r].items.size());
      REQUIRE(a.file < rp.files);
      const WriteItem& it = plans[r].items[a.item];
      const Box& b = ferry::chunk_box(a, it);
      // A rank writes only what it holds.
      REQUIRE(inside(b, it.box));
      written[it.key].push_back({static_cast<int32_t>(r), b});
      bytes += static_cast<uint64_t>(numel(b.sizes)) * ferry::dtype_size(it.dtype);
    }
    CHECK(bytes == rp.bytes);
    load[r] = bytes;
  }
  // Every element of every tensor written exactly once.
  uint64_t total = 0;
  std::map<std::string, const WriteItem*> first;
  for (const auto& p : plans)
    for (const auto& it : p.items) first.emplace(it.key, &it);
  for (const auto& [key, it] : first) {
    total += static_cast<uint64_t>(numel(it->global_shape)) * ferry::dtype_size(it->dtype);
    const auto& chunks = written[key];
    // Even a tensor without elements is written (as one empty chunk), so
    // the manifest lists every key.
    CHECK_FALSE(chunks.empty());
    int64_t covered = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
      covered += numel(chunks[i].second.sizes);
      for (size_t j = i + 1; j < chunks.size(); ++j) {
        INFO("key " << key);
        CHECK_FALSE(overlap(chunks[i].second, chunks[j].second));
      }
    }
    INFO("key " << key);
    CHECK(covered == numel(it->global_shape));
  }
  CHECK(gp.total_bytes == total);

  // Replica groups: (key, box) -> holders, and their sizes.
  std::map<std::pair<std::string, std::vector<int64_t>>, std::vector<int32_t>> groups;
  std::map<std::pair<std::string, std::vector<int64_t>>, uint64_t> group_bytes;
  for (const auto& p : plans)
    for (const auto& it : p.items) {
      std::vector<int64_t> id = it.box.offsets;
      id.insert(id.end(), it.box.sizes.begin(), it.box.sizes.end());
      groups[{it.key, id}].push_back(p.rank);
      group_bytes[{it.key, id}] = it.nbytes;
    }
  // Empty shards (a rank holding zero rows) are not items anyone writes.
  size_t nonempty = 0;
  for (const auto& [k, holders] : groups) {
    const std::vector<int64_t> sizes(k.second.begin() + k.second.size() / 2, k.second.end());
    nonempty += numel(sizes) > 0;
  }
  // A tensor with no elements at all is still recorded, by one rank.
  for (const auto& [key, it] : first) nonempty += numel(it->global_shape) == 0;
  CHECK(gp.unique_items == nonempty);

  if (opts.policy == OwnerPolicy::lowest_rank) {
    // Each group is written whole by its lowest rank.
    for (const auto& [k, holders] : groups) {
      const int32_t lowest = *std::min_element(holders.begin(), holders.end());
      if (group_bytes[k] == 0) continue;
      for (const auto& [rank, box] : written[k.first]) {
        std::vector<int64_t> id = box.offsets;
        id.insert(id.end(), box.sizes.begin(), box.sizes.end());
        if (id == k.second) {
          INFO("key " << k.first);
          CHECK(rank == lowest);
        }
      }
    }
    return;
  }
  // Balanced: the most loaded rank carries at most
  // max(largest fixed load, total / ranks) + the largest item.
  std::vector<uint64_t> fixed(plans.size(), 0);
  uint64_t largest = 0;
  for (const auto& [k, holders] : groups) {
    largest = std::max(largest, group_bytes[k]);
    if (holders.size() == 1) fixed[holders[0]] += group_bytes[k];
  }
  const uint64_t bound =
      std::max(*std::max_element(fixed.begin(), fixed.end()), total / plans.size()) + largest;
  CHECK(*std::max_element(load.begin(), load.end()) <= bound);
}

}  // namespace

TEST_CASE("the global planner agrees with a plain reference on random inputs",
          "[plan][reference]") {
  std::mt19937_64 rng(20261201);
  int valid = 0, refused = 0;
  const Breakage kinds[] = {Breakage::none,    Breakage::none,  Breakage::none, Breakage::gap,
                            Breakage::overlap, Breakage::dtype, Breakage::shape};
  for (int iter = 0; iter < 3000; ++iter) {
    const int world = std::uniform_int_distribution<int>(1, 8)(rng);
    const int keys = std::uniform_int_distribution<int>(1, 6)(rng);
    std::vector<Tensor> ts;
    std::map<std::string, Breakage> broken;
    for (int k = 0; k < keys; ++k) {
      Tensor t = random_tensor("layer" + std::to_string(k) + ".w", world, rng);
      const Breakage b = iter % 3 == 0 ? kinds[rng() % std::size(kinds)] : Breakage::none;
      if (b != Breakage::none && brk(&t, b, world, rng)) broken[t.key] = b;
      ts.push_back(std::move(t));
    }
    auto plans = to_plans(ts, world, broken);
    GlobalPlanOptions opts;
    opts.policy = rng() % 3 == 0 ? OwnerPolicy::lowest_rank : OwnerPolicy::balanced;
    opts.split_bytes = rng() % 2 ? 0 : std::uniform_int_distribution<uint64_t>(1, 2000)(rng);
    opts.files_per_rank = std::uniform_int_distribution<uint32_t>(1, 3)(rng);
    const bool ok = reference_valid(plans);
    auto gp = ferry::make_global_plan(plans, opts);
    INFO("iteration " << iter << ", world " << world << ", "
                      << (gp.ok() ? std::string("planned") : gp.status().to_string()));
    REQUIRE(gp.ok() == ok);
    if (!ok) {
      ++refused;
      // The error names one of the keys that were broken.
      bool named = false;
      for (const auto& [key, b] : broken)
        named = named || gp.status().message().find(key) != std::string::npos;
      CHECK(named);
      continue;
    }
    ++valid;
    check_plan(plans, *gp, opts);
    // Deterministic: the same inputs give the same plan.
    auto again = ferry::make_global_plan(plans, opts);
    REQUIRE(again.ok());
    for (size_t r = 0; r < gp->ranks.size(); ++r)
      CHECK(again->ranks[r].bytes == gp->ranks[r].bytes);
  }
  // The generator produced both kinds in earnest.
  CHECK(valid > 1500);
  CHECK(refused > 300);
}

// The public planner (ferry/planner.hpp) on the same random inputs: what a
// user sees from ferry::plan::global_plan is the internal plan, every byte
// written once, owners by policy, the load bound, and plans that survive
// their byte form.
TEST_CASE("the public global plan: every byte once, owners by policy, bounded load, bytes",
          "[plan][reference][planner_api]") {
  std::mt19937_64 rng(20261202);
  int checked = 0;
  for (int iter = 0; iter < 1500; ++iter) {
    const int world = std::uniform_int_distribution<int>(1, 8)(rng);
    const int keys = std::uniform_int_distribution<int>(1, 6)(rng);
    std::vector<Tensor> ts;
    for (int k = 0; k < keys; ++k)
      ts.push_back(random_tensor("layer" + std::to_string(k) + ".w", world, rng));
    auto plans = to_plans(ts, world, {});
    const auto policy = rng() % 2 ? OwnerPolicy::lowest_rank : OwnerPolicy::balanced;
    std::vector<ferry::LocalSavePlan> locals;
    for (const auto& p : plans) locals.push_back(ferry::to_public(p));
    auto sp = ferry::plan::global_plan(locals, policy);
    INFO("iteration " << iter << ", world " << world);
    REQUIRE(sp.ok());
    REQUIRE(sp->size() == plans.size());
    ++checked;
    // The same plan the coordinator makes (default split and files).
    GlobalPlanOptions o;
    o.policy = policy;
    auto gp = ferry::make_global_plan(plans, o);
    REQUIRE(gp.ok());
    std::map<std::string, std::vector<Box>> written;   // key -> boxes written
    std::map<std::string, std::set<int32_t>> writers;  // key + box of the item -> who writes
    std::vector<uint64_t> load;
    for (size_t r = 0; r < sp->size(); ++r) {
      const ferry::SavePlan& p = (*sp)[r];
      REQUIRE(p.rank == static_cast<int32_t>(r));
      REQUIRE(p.writes.size() == gp->ranks[r].chunks.size());
      CHECK(p.bytes == gp->ranks[r].bytes);
      uint64_t sum = 0;
      for (const auto& w : p.writes) {
        REQUIRE(w.item < p.items.size());
        REQUIRE(w.file < p.files.size());
        const auto& it = p.items[w.item];
        const Box b{w.offsets, w.sizes};
        CHECK(inside(b, Box{it.offsets, it.sizes}));
        CHECK(w.nbytes == static_cast<uint64_t>(numel(w.sizes)) * ferry::dtype_size(it.dtype));
        written[it.key].push_back(b);
        writers[it.key + Box{it.offsets, it.sizes}.to_string()].insert(p.rank);
        sum += w.nbytes;
      }
      CHECK(sum == p.bytes);
      load.push_back(p.bytes);
      // Serializable: the bytes give back the same plan.
      auto back = ferry::SavePlan::from_bytes(p.to_bytes());
      REQUIRE(back.ok());
      CHECK(back->to_bytes() == p.to_bytes());
      CHECK(back->to_string() == p.to_string());
      auto lback = ferry::LocalSavePlan::from_bytes(locals[r].to_bytes());
      REQUIRE(lback.ok());
      CHECK(lback->to_bytes() == locals[r].to_bytes());
    }
    // Every byte of every tensor written exactly once.
    uint64_t total = 0;
    uint64_t largest = 0;
    for (const Tensor& t : ts) {
      const auto& boxes = written[t.key];
      int64_t covered = 0;
      for (size_t i = 0; i < boxes.size(); ++i) {
        covered += numel(boxes[i].sizes);
        for (size_t j = i + 1; j < boxes.size(); ++j) CHECK_FALSE(overlap(boxes[i], boxes[j]));
      }
      INFO("key " << t.key);
      CHECK(covered == numel(t.shape));
      total += static_cast<uint64_t>(numel(t.shape)) * ferry::dtype_size(t.dtype);
    }
    // Owners: what every holder of an item is told matches who writes it;
    // lowest_rank: exactly the lowest holder of a non-empty piece.
    std::vector<uint64_t> fixed(plans.size(), 0);
    for (const Tensor& t : ts)
      for (const Piece& piece : t.pieces) {
        const uint64_t bytes =
            static_cast<uint64_t>(numel(piece.box.sizes)) * ferry::dtype_size(t.dtype);
        largest = std::max(largest, bytes);
        if (piece.holders.size() == 1) fixed[piece.holders[0]] += bytes;
        const auto& who = writers[t.key + piece.box.to_string()];
        for (int32_t h : piece.holders) {
          const ferry::SavePlan& p = (*sp)[h];
          for (size_t i = 0; i < p.items.size(); ++i)
            if (p.items[i].key == t.key && Box{p.items[i].offsets, p.items[i].sizes} == piece.box)
              CHECK(std::set<int32_t>(p.owners[i].begin(), p.owners[i].end()) == who);
        }
        if (policy == OwnerPolicy::lowest_rank && bytes > 0) {
          INFO("key " << t.key << " piece " << piece.box.to_string());
          CHECK(who ==
                std::set<int32_t>{*std::min_element(piece.holders.begin(), piece.holders.end())});
        }
      }
    if (policy == OwnerPolicy::balanced) {
      const uint64_t bound =
          std::max(*std::max_element(fixed.begin(), fixed.end()), total / plans.size()) + largest;
      CHECK(*std::max_element(load.begin(), load.end()) <= bound);
    }
    // Deterministic: a second call says the same, byte for byte.
    auto again = ferry::plan::global_plan(locals, policy);
    REQUIRE(again.ok());
    CHECK(ferry::encode_save_plans(*again) == ferry::encode_save_plans(*sp));
  }
  CHECK(checked == 1500);
}

// A plan with no job names and cuts its files as a save with the same file
// options writes them: the preview a user compares with the root.
TEST_CASE("the public global plan names the files a save with the same options writes",
          "[plan][planner_api]") {
  ferry::LocalSavePlan local;
  for (int k = 0; k < 3; ++k)
    local.items.push_back({"w" + std::to_string(k), DType::f32, {4, 2}, {0, 0}, {4, 2}, 32, 0});
  std::vector<ferry::LocalSavePlan> locals{local};

  auto plain = ferry::plan::global_plan(locals);
  REQUIRE(plain.ok());
  CHECK((*plain)[0].files == std::vector<std::string>{"rank-00000-0000.safetensors"});

  ferry::SaveOptions o;
  o.filename_prefix = "model";
  o.shard_size = 40;  // one 32-byte tensor per file
  auto cut = ferry::plan::global_plan(locals, OwnerPolicy::balanced, o);
  REQUIRE(cut.ok());
  CHECK((*cut)[0].files == std::vector<std::string>{"model-00000-0000.safetensors",
                                                    "model-00000-0001.safetensors",
                                                    "model-00000-0002.safetensors"});

  o.compress = "zstd";
  auto packed = ferry::plan::global_plan(locals, OwnerPolicy::balanced, o);
  REQUIRE(packed.ok());
  auto fo = ferry::resolve_data_files(ferry::Options{}, o, false);
  REQUIRE(fo.ok());
  REQUIRE(fo->extension() != "safetensors");
  REQUIRE_FALSE((*packed)[0].files.empty());
  for (const std::string& f : (*packed)[0].files) {
    CHECK(f.rfind("model-00000-", 0) == 0);
    CHECK(f.substr(f.size() - fo->extension().size()) == fo->extension());
  }

  ferry::SaveOptions bad;
  bad.filename_prefix = "../escape";
  auto refused = ferry::plan::global_plan(locals, OwnerPolicy::balanced, bad);
  REQUIRE_FALSE(refused.ok());
  CHECK_THAT(refused.status().message(), Catch::Contains("filename_prefix"));
}

TEST_CASE("the public planner refuses malformed input, naming what is wrong",
          "[plan][planner_api]") {
  ferry::LocalSavePlan a;
  a.rank = 1;  // in slot 0
  auto r = ferry::plan::global_plan({a});
  REQUIRE_FALSE(r.ok());
  CHECK_THAT(r.status().message(), Catch::Contains("local_plans[0] is rank 1"));

  ferry::LocalSavePlan p;
  p.items.push_back({"w", DType::f32, {4, 2}, {0, 0}, {4, 2}, 32, 0});
  std::string bytes = p.to_bytes();
  auto cut = ferry::LocalSavePlan::from_bytes(bytes.substr(0, bytes.size() - 3));
  REQUIRE_FALSE(cut.ok());
  CHECK_THAT(cut.status().message(), Catch::Contains("truncated"));
  auto garbage = ferry::SavePlan::from_bytes("not a plan at all");
  REQUIRE_FALSE(garbage.ok());
  CHECK_THAT(garbage.status().message(), Catch::Contains("bad magic"));
  p.items[0].sizes = {5, 2};  // outside its shape
  auto outside = ferry::LocalSavePlan::from_bytes(p.to_bytes());
  REQUIRE_FALSE(outside.ok());
  CHECK_THAT(outside.status().message(), Catch::Contains("\"w\"") && Catch::Contains("outside"));

  // A transform may drop and rename, nothing else.
  LocalPlan original;
  original.items.push_back({"w", DType::f32, {4, 2}, Box{{0, 0}, {4, 2}}, 32, 0});
  original.items.push_back({"b", DType::f32, {2}, Box{{0}, {2}}, 8, 1});
  ferry::LocalSavePlan t = ferry::to_public(original);
  t.items.erase(t.items.begin());
  t.items[0].key = "bias";
  CHECK(ferry::check_transformed(original, t).ok());
  t.items[0].nbytes = 4;
  auto bad = ferry::check_transformed(original, t);
  CHECK_THAT(bad.message(), Catch::Contains("\"bias\"") && Catch::Contains("only the key"));
}
