// The public planner types (ferry/planner.hpp): conversions from the internal
// planner, printing, and a byte form. Planning itself stays in plan.cpp.

#include "planner_api.hpp"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "layout.hpp"
#include "text.hpp"

namespace ferry {

namespace {

Box box_of(const PlanItem& it) {
  return Box{it.offsets, it.sizes};
}

PlanItem item_of(const WriteItem& w) {
  return PlanItem{w.key, w.dtype, w.global_shape, w.box.offsets, w.box.sizes, w.nbytes, w.entry};
}

// A replica group: the items several ranks hold alike.
std::string group_key(const WriteItem& w) {
  return w.key + '\0' + dtype_name(w.dtype) + shape_to_string(w.global_shape) + w.box.to_string();
}

std::string item_line(const PlanItem& it) {
  return quote_value(it.key) + " " + dtype_name(it.dtype) + " " +
         box_to_string(it.offsets.data(), it.sizes.data(),
                       std::min(it.offsets.size(), it.sizes.size())) +
         " of " + shape_to_string(it.global_shape) + " " + std::to_string(it.nbytes) + " B";
}

// Little-endian, length-prefixed; the reader checks every length against
// what is left, so a truncated or hostile buffer is an error, not a crash.
class Writer {
 public:
  explicit Writer(const char* magic) : buf_(magic) {}
  void u32(uint32_t v) { put(v, 4); }
  void u64(uint64_t v) { put(v, 8); }
  void str(const std::string& s) {
    u64(s.size());
    buf_ += s;
  }
  void dims(const std::vector<int64_t>& v) {
    u32(static_cast<uint32_t>(v.size()));
    for (int64_t x : v) u64(static_cast<uint64_t>(x));
  }
  std::string take() { return std::move(buf_); }

 private:
  void put(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) buf_.push_back(static_cast<char>(v >> (8 * i)));
  }
  std::string buf_;
};

class Reader {
 public:
  Reader(const std::string& b, const char* what) : b_(b), what_(what) {}
  Status magic(const char* m) {
    const size_t n = std::strlen(m);
    if (b_.compare(0, n, m) != 0)
      return Status::invalid_argument(std::string(what_) + ": not a Ferry " + what_ +
                                      " (bad magic)");
    pos_ = n;
    return Status();
  }
  Result<uint64_t> u64() { return get(8); }
  Result<uint32_t> u32() {
    FERRY_ASSIGN_OR_RETURN(uint64_t v, get(4));
    return static_cast<uint32_t>(v);
  }
  Result<std::string> str() {
    FERRY_ASSIGN_OR_RETURN(uint64_t n, u64());
    if (n > left()) return truncated();
    std::string s = b_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  Result<std::vector<int64_t>> dims() {
    FERRY_ASSIGN_OR_RETURN(uint32_t n, count(8));
    std::vector<int64_t> v(n);
    for (auto& x : v) {
      FERRY_ASSIGN_OR_RETURN(uint64_t u, u64());
      x = static_cast<int64_t>(u);
    }
    return v;
  }
  // A count of elements at least `min_bytes` each, bounded by what is left.
  Result<uint32_t> count(uint64_t min_bytes) {
    FERRY_ASSIGN_OR_RETURN(uint32_t n, u32());
    if (n * min_bytes > left()) return truncated();
    return n;
  }
  Status end() const {
    if (pos_ != b_.size())
      return Status::invalid_argument(std::string(what_) + ": " + std::to_string(left()) +
                                      " bytes after the end");
    return Status();
  }

 private:
  uint64_t left() const { return b_.size() - pos_; }
  Status truncated() const {
    return Status::invalid_argument(std::string(what_) + ": truncated at byte " +
                                    std::to_string(pos_) + " of " + std::to_string(b_.size()));
  }
  Result<uint64_t> get(int n) {
    if (left() < static_cast<uint64_t>(n)) return truncated();
    uint64_t v = 0;
    for (int i = 0; i < n; ++i)
      v |= static_cast<uint64_t>(static_cast<uint8_t>(b_[pos_ + i])) << (8 * i);
    pos_ += n;
    return v;
  }
  const std::string& b_;
  const char* what_;
  size_t pos_ = 0;
};

void put_item(Writer& w, const PlanItem& it) {
  w.str(it.key);
  w.str(dtype_name(it.dtype));
  w.dims(it.global_shape);
  w.dims(it.offsets);
  w.dims(it.sizes);
  w.u64(it.nbytes);
  w.u32(it.entry);
}

Result<PlanItem> get_item(Reader& r, size_t index) {
  PlanItem it;
  FERRY_ASSIGN_OR_RETURN(it.key, r.str());
  FERRY_ASSIGN_OR_RETURN(std::string dt, r.str());
  const std::string where = "item " + std::to_string(index) + " " + quote_value(it.key);
  auto d = parse_dtype(dt);
  if (!d.ok()) return d.status().with_context(where + ": ");
  it.dtype = *d;
  FERRY_ASSIGN_OR_RETURN(it.global_shape, r.dims());
  FERRY_ASSIGN_OR_RETURN(it.offsets, r.dims());
  FERRY_ASSIGN_OR_RETURN(it.sizes, r.dims());
  FERRY_ASSIGN_OR_RETURN(it.nbytes, r.u64());
  FERRY_ASSIGN_OR_RETURN(it.entry, r.u32());
  if (it.offsets.size() != it.global_shape.size() || it.sizes.size() != it.global_shape.size())
    return Status::invalid_argument(where + ": region " + box_of(it).to_string() +
                                    " does not match shape " + shape_to_string(it.global_shape));
  if (!Box::whole(it.global_shape).contains(box_of(it)))
    return Status::invalid_argument(where + ": region " + box_of(it).to_string() +
                                    " outside shape " + shape_to_string(it.global_shape));
  return it;
}

constexpr const char* kLocalMagic = "FRYLPLN1";
constexpr const char* kRankMagic = "FRYSPLN1";
constexpr const char* kListMagic = "FRYGPLN1";

}  // namespace

LocalSavePlan to_public(const LocalPlan& p) {
  LocalSavePlan out;
  out.rank = p.rank;
  for (const auto& w : p.items) out.items.push_back(item_of(w));
  return out;
}

LocalPlan to_internal(const LocalSavePlan& p) {
  LocalPlan out;
  out.rank = p.rank;
  for (const auto& it : p.items)
    out.items.push_back(
        WriteItem{it.key, it.dtype, it.global_shape, box_of(it), it.nbytes, it.entry});
  return out;
}

std::vector<SavePlan> save_plans(const std::vector<LocalPlan>& locals, const GlobalPlan& gp) {
  std::map<std::string, std::set<int32_t>> writers;
  for (const RankPlan& rp : gp.ranks)
    for (const ChunkAssignment& a : rp.chunks)
      writers[group_key(locals[rp.rank].items[a.item])].insert(rp.rank);
  std::vector<SavePlan> out;
  for (const RankPlan& rp : gp.ranks) {
    const LocalPlan& local = locals[rp.rank];
    SavePlan sp;
    sp.rank = rp.rank;
    for (const WriteItem& w : local.items) {
      sp.items.push_back(item_of(w));
      const auto& who = writers[group_key(w)];
      sp.owners.emplace_back(who.begin(), who.end());
    }
    // A file no chunk goes to is not created (planner.cpp), so not listed.
    std::vector<int64_t> file_index(rp.files, -1);
    for (const ChunkAssignment& a : rp.chunks) {
      if (file_index[a.file] < 0) {
        file_index[a.file] = static_cast<int64_t>(sp.files.size());
        sp.files.push_back(data_file_name(rp.rank, a.file));
      }
      const WriteItem& w = local.items[a.item];
      const Box& b = chunk_box(a, w);
      const uint64_t n = a.whole ? w.nbytes : b.numel() * dtype_size(w.dtype);
      sp.writes.push_back(
          {a.item, b.offsets, b.sizes, n, static_cast<uint32_t>(file_index[a.file])});
      sp.bytes += n;
    }
    out.push_back(std::move(sp));
  }
  return out;
}

Status check_transformed(const LocalPlan& original, const LocalSavePlan& t) {
  if (t.rank != original.rank)
    return Status::invalid_argument("the transformed local plan is rank " + std::to_string(t.rank) +
                                    "'s, this is rank " + std::to_string(original.rank));
  std::set<std::string> keys;
  for (size_t i = 0; i < t.items.size(); ++i) {
    const PlanItem& it = t.items[i];
    const std::string where =
        "transformed local plan item " + std::to_string(i) + " " + quote_value(it.key);
    if (it.key.empty()) return Status::invalid_argument(where + ": empty key");
    if (!keys.insert(it.key).second)
      return Status::invalid_argument(where + ": the key appears twice");
    if (it.entry >= original.items.size())
      return Status::invalid_argument(where + ": entry " + std::to_string(it.entry) +
                                      " is not in the state dict (items may be dropped or "
                                      "renamed, not added)");
    const WriteItem& o = original.items[it.entry];
    if (it.dtype != o.dtype || it.global_shape != o.global_shape || box_of(it) != o.box ||
        it.nbytes != o.nbytes)
      return Status::invalid_argument(where + ": dtype, shape or region differ from entry " +
                                      std::to_string(it.entry) + " " + quote_value(o.key) +
                                      " (only the key may change)");
  }
  return Status();
}

std::string LocalSavePlan::to_string() const {
  std::string s = "local plan of rank " + std::to_string(rank) + ": " +
                  std::to_string(items.size()) + " items\n";
  for (size_t i = 0; i < items.size(); ++i)
    s += "  item " + std::to_string(i) + ": " + item_line(items[i]) + "\n";
  return s;
}

std::string LocalSavePlan::to_bytes() const {
  Writer w(kLocalMagic);
  w.u32(static_cast<uint32_t>(rank));
  w.u32(static_cast<uint32_t>(items.size()));
  for (const auto& it : items) put_item(w, it);
  return w.take();
}

Result<LocalSavePlan> LocalSavePlan::from_bytes(const std::string& bytes) {
  Reader r(bytes, "local plan");
  FERRY_RETURN_IF_ERROR(r.magic(kLocalMagic));
  LocalSavePlan p;
  FERRY_ASSIGN_OR_RETURN(uint32_t rank, r.u32());
  p.rank = static_cast<int32_t>(rank);
  FERRY_ASSIGN_OR_RETURN(uint32_t n, r.count(40));
  for (uint32_t i = 0; i < n; ++i) {
    FERRY_ASSIGN_OR_RETURN(PlanItem it, get_item(r, i));
    p.items.push_back(std::move(it));
  }
  FERRY_RETURN_IF_ERROR(r.end());
  return p;
}

std::string SavePlan::to_string() const {
  std::string s = "plan of rank " + std::to_string(rank) + ": writes " + std::to_string(bytes) +
                  " B in " + std::to_string(writes.size()) + " pieces to " +
                  std::to_string(files.size()) + " files\n";
  for (size_t i = 0; i < items.size(); ++i) {
    std::string who;
    for (int32_t r : owners[i]) who += (who.empty() ? "" : ",") + std::to_string(r);
    s += "  item " + std::to_string(i) + ": " + item_line(items[i]) + " written by rank " +
         (who.empty() ? "(none)" : who) + "\n";
  }
  for (const auto& wr : writes)
    s += "  write item " + std::to_string(wr.item) + " " +
         box_to_string(wr.offsets.data(), wr.sizes.data(),
                       std::min(wr.offsets.size(), wr.sizes.size())) +
         " " + std::to_string(wr.nbytes) + " B -> " + files[wr.file] + "\n";
  return s;
}

std::string SavePlan::to_bytes() const {
  Writer w(kRankMagic);
  w.u32(static_cast<uint32_t>(rank));
  w.u32(static_cast<uint32_t>(items.size()));
  for (size_t i = 0; i < items.size(); ++i) {
    put_item(w, items[i]);
    const auto& o = i < owners.size() ? owners[i] : std::vector<int32_t>{};
    w.u32(static_cast<uint32_t>(o.size()));
    for (int32_t r : o) w.u32(static_cast<uint32_t>(r));
  }
  w.u32(static_cast<uint32_t>(writes.size()));
  for (const auto& wr : writes) {
    w.u32(wr.item);
    w.dims(wr.offsets);
    w.dims(wr.sizes);
    w.u64(wr.nbytes);
    w.u32(wr.file);
  }
  w.u32(static_cast<uint32_t>(files.size()));
  for (const auto& f : files) w.str(f);
  w.u64(bytes);
  return w.take();
}

Result<SavePlan> SavePlan::from_bytes(const std::string& bytes) {
  Reader r(bytes, "save plan");
  FERRY_RETURN_IF_ERROR(r.magic(kRankMagic));
  SavePlan p;
  FERRY_ASSIGN_OR_RETURN(uint32_t rank, r.u32());
  p.rank = static_cast<int32_t>(rank);
  FERRY_ASSIGN_OR_RETURN(uint32_t n, r.count(44));
  for (uint32_t i = 0; i < n; ++i) {
    FERRY_ASSIGN_OR_RETURN(PlanItem it, get_item(r, i));
    p.items.push_back(std::move(it));
    FERRY_ASSIGN_OR_RETURN(uint32_t k, r.count(4));
    std::vector<int32_t> o(k);
    for (auto& x : o) {
      FERRY_ASSIGN_OR_RETURN(uint32_t v, r.u32());
      x = static_cast<int32_t>(v);
    }
    p.owners.push_back(std::move(o));
  }
  FERRY_ASSIGN_OR_RETURN(uint32_t nw, r.count(24));
  for (uint32_t i = 0; i < nw; ++i) {
    PlannedWrite wr;
    FERRY_ASSIGN_OR_RETURN(wr.item, r.u32());
    FERRY_ASSIGN_OR_RETURN(wr.offsets, r.dims());
    FERRY_ASSIGN_OR_RETURN(wr.sizes, r.dims());
    FERRY_ASSIGN_OR_RETURN(wr.nbytes, r.u64());
    FERRY_ASSIGN_OR_RETURN(wr.file, r.u32());
    if (wr.item >= p.items.size())
      return Status::invalid_argument("save plan: write " + std::to_string(i) + " names item " +
                                      std::to_string(wr.item) + " of " +
                                      std::to_string(p.items.size()));
    p.writes.push_back(std::move(wr));
  }
  FERRY_ASSIGN_OR_RETURN(uint32_t nf, r.count(8));
  for (uint32_t i = 0; i < nf; ++i) {
    FERRY_ASSIGN_OR_RETURN(std::string f, r.str());
    p.files.push_back(std::move(f));
  }
  for (size_t i = 0; i < p.writes.size(); ++i)
    if (p.writes[i].file >= p.files.size())
      return Status::invalid_argument("save plan: write " + std::to_string(i) + " names file " +
                                      std::to_string(p.writes[i].file) + " of " +
                                      std::to_string(p.files.size()));
  FERRY_ASSIGN_OR_RETURN(p.bytes, r.u64());
  FERRY_RETURN_IF_ERROR(r.end());
  return p;
}

std::string encode_save_plans(const std::vector<SavePlan>& plans) {
  Writer w(kListMagic);
  w.u32(static_cast<uint32_t>(plans.size()));
  for (const auto& p : plans) w.str(p.to_bytes());
  return w.take();
}

Result<std::vector<SavePlan>> decode_save_plans(const std::string& bytes) {
  Reader r(bytes, "global plan");
  FERRY_RETURN_IF_ERROR(r.magic(kListMagic));
  FERRY_ASSIGN_OR_RETURN(uint32_t n, r.count(8));
  std::vector<SavePlan> out;
  for (uint32_t i = 0; i < n; ++i) {
    FERRY_ASSIGN_OR_RETURN(std::string b, r.str());
    auto p = SavePlan::from_bytes(b);
    if (!p.ok()) return p.status().with_context("rank " + std::to_string(i) + "'s ");
    out.push_back(std::move(p).value());
  }
  FERRY_RETURN_IF_ERROR(r.end());
  return out;
}

namespace plan {

Result<std::vector<SavePlan>> global_plan(const std::vector<LocalSavePlan>& local_plans,
                                          OwnerPolicy policy) {
  std::vector<LocalPlan> locals;
  for (size_t r = 0; r < local_plans.size(); ++r) {
    if (local_plans[r].rank != static_cast<int32_t>(r))
      return Status::invalid_argument("local_plans[" + std::to_string(r) + "] is rank " +
                                      std::to_string(local_plans[r].rank) +
                                      "'s plan: pass one plan per rank, in rank order");
    locals.push_back(to_internal(local_plans[r]));
  }
  GlobalPlanOptions o;
  o.policy = policy;
  FERRY_ASSIGN_OR_RETURN(GlobalPlan gp, make_global_plan(locals, o));
  return save_plans(locals, gp);
}

Result<LocalSavePlan> local_plan(const StateDict& sd, int32_t rank) {
  FERRY_ASSIGN_OR_RETURN(LocalPlan p, make_local_plan(sd, rank));
  return to_public(p);
}

}  // namespace plan

}  // namespace ferry
