// The public planner types (ferry/save_plan.hpp): conversions from the internal
// planner, printing, and the byte forms (Cap'n Proto, schemas/plan.capnp).
// Planning itself stays in plan.cpp.

#include "planner_api.hpp"
#include "capnp_text.hpp"

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/array.h>
#include <kj/exception.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <map>
#include <new>
#include <set>

#include "layout.hpp"
#include "plan.capnp.h"
#include "text.hpp"

namespace ferry {

namespace {

using capnp_util::fill;
using capnp_util::i64s;
using capnp_util::str;
using capnp_util::text;

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

// --- byte forms (schemas/plan.capnp) -------------------------------------------------
//
// Magic naming the kind, then one Cap'n Proto message. The bytes may come from
// anywhere (a user's file, another process), so decoding is a boundary like
// protocol.cpp's: limits sized from the input, every Cap'n Proto exception
// caught, and nothing returned whose indices, regions or sizes the rest of
// Ferry could trip over.

constexpr size_t kMagicBytes = 8;
constexpr char kLocalMagic[] = "FRYLPLN2";
constexpr char kRankMagic[] = "FRYSPLN2";
constexpr char kListMagic[] = "FRYGPLN2";

const char* kind_of(const std::string& bytes) {
  if (bytes.size() < kMagicBytes) return nullptr;
  if (bytes.compare(0, kMagicBytes, kLocalMagic) == 0) return "local plan";
  if (bytes.compare(0, kMagicBytes, kRankMagic) == 0) return "save plan";
  if (bytes.compare(0, kMagicBytes, kListMagic) == 0) return "global plan";
  return nullptr;
}

// The magic, then the message whose root `build` fills in.
template <class Root, class Build>
std::string framed(const char* magic, Build build) {
  capnp::MallocMessageBuilder mb;
  build(mb.initRoot<Root>());
  kj::Array<capnp::word> words = capnp::messageToFlatArray(mb);
  kj::ArrayPtr<const kj::byte> b = words.asBytes();
  std::string out(magic, kMagicBytes);
  out.append(reinterpret_cast<const char*>(b.begin()), b.size());
  return out;
}

void set_box(proto::Box::Builder b, const std::vector<int64_t>& offsets,
             const std::vector<int64_t>& sizes) {
  fill(b.initOffsets(static_cast<unsigned>(offsets.size())), offsets);
  fill(b.initSizes(static_cast<unsigned>(sizes.size())), sizes);
}

void set_item(proto::WriteItem::Builder b, const PlanItem& it) {
  b.setKey(text(it.key));
  b.setDtype(text(dtype_name(it.dtype)));
  fill(b.initGlobalShape(static_cast<unsigned>(it.global_shape.size())), it.global_shape);
  set_box(b.initBox(), it.offsets, it.sizes);
  b.setNbytes(it.nbytes);
  b.setEntry(it.entry);
}

void set_local(proto::LocalPlan::Builder b, const LocalSavePlan& p) {
  b.setRank(p.rank);
  auto items = b.initItems(static_cast<unsigned>(p.items.size()));
  for (size_t i = 0; i < p.items.size(); ++i) set_item(items[static_cast<unsigned>(i)], p.items[i]);
}

void set_rank_plan(proto::SavePlan::Builder b, const SavePlan& p) {
  b.setRank(p.rank);
  const auto n = static_cast<unsigned>(p.items.size());
  auto items = b.initItems(n);
  auto owners = b.initOwners(n);
  for (unsigned i = 0; i < n; ++i) {
    set_item(items[i], p.items[i]);
    if (i < p.owners.size())
      fill(owners[i].initRanks(static_cast<unsigned>(p.owners[i].size())), p.owners[i]);
  }
  auto writes = b.initWrites(static_cast<unsigned>(p.writes.size()));
  for (size_t i = 0; i < p.writes.size(); ++i) {
    const PlannedWrite& w = p.writes[i];
    auto wb = writes[static_cast<unsigned>(i)];
    wb.setItem(w.item);
    set_box(wb.initBox(), w.offsets, w.sizes);
    wb.setNbytes(w.nbytes);
    wb.setFile(w.file);
  }
  auto files = b.initFiles(static_cast<unsigned>(p.files.size()));
  for (size_t i = 0; i < p.files.size(); ++i) files.set(static_cast<unsigned>(i), text(p.files[i]));
  b.setBytes(p.bytes);
}

// A region (offsets, sizes) inside the region (lo, extent) of the same rank,
// with no arithmetic that can overflow on hostile values.
Status check_inside(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
                    const std::vector<int64_t>& lo, const std::vector<int64_t>& extent,
                    const std::string& where, const std::string& outer) {
  const std::string region =
      "region (offsets " + shape_to_string(offsets) + ", sizes " + shape_to_string(sizes) + ")";
  if (offsets.size() != extent.size() || sizes.size() != extent.size())
    return Status::invalid_argument(where + ": " + region + " does not match the " +
                                    std::to_string(extent.size()) + " dimensions of " + outer);
  for (size_t d = 0; d < extent.size(); ++d)
    if (offsets[d] < lo[d] || sizes[d] < 0 || offsets[d] - lo[d] > extent[d] - sizes[d])
      return Status::invalid_argument(where + ": " + region + " outside " + outer + " in dim " +
                                      std::to_string(d));
  return Status();
}

// nbytes must be what the region holds; a count that overflows is refused.
Status check_nbytes(const std::vector<int64_t>& sizes, DType dtype, uint64_t nbytes,
                    const std::string& where) {
  uint64_t want = dtype_size(dtype);
  for (int64_t s : sizes)
    if (__builtin_mul_overflow(want, static_cast<uint64_t>(s), &want))
      return Status::invalid_argument(where + ": region too large");
  if (want != nbytes)
    return Status::invalid_argument(where + ": nbytes " + std::to_string(nbytes) + ", the region " +
                                    "of " + dtype_name(dtype) + " holds " + std::to_string(want));
  return Status();
}

Result<PlanItem> read_item(proto::WriteItem::Reader r, size_t index) {
  PlanItem it;
  it.key = str(r.getKey());
  const std::string where = "item " + std::to_string(index) + " " + quote_value(it.key);
  auto d = parse_dtype(str(r.getDtype()));
  if (!d.ok()) return d.status().with_context(where + ": ");
  it.dtype = *d;
  it.global_shape = i64s(r.getGlobalShape());
  it.offsets = i64s(r.getBox().getOffsets());
  it.sizes = i64s(r.getBox().getSizes());
  it.nbytes = r.getNbytes();
  it.entry = r.getEntry();
  for (size_t k = 0; k < it.global_shape.size(); ++k)
    if (it.global_shape[k] < 0)
      return Status::invalid_argument(where + ": negative dimension in shape " +
                                      shape_to_string(it.global_shape));
  FERRY_RETURN_IF_ERROR(
      check_inside(it.offsets, it.sizes, std::vector<int64_t>(it.global_shape.size(), 0),
                   it.global_shape, where, "shape " + shape_to_string(it.global_shape)));
  FERRY_RETURN_IF_ERROR(check_nbytes(it.sizes, it.dtype, it.nbytes, where));
  return it;
}

Status read_rank(int32_t rank, const char* what) {
  if (rank < 0)
    return Status::invalid_argument(std::string(what) + ": negative rank " + std::to_string(rank));
  return Status();
}

// The rank and the items, which a local plan and a rank's save plan share.
template <class Reader, class Plan>
Status read_rank_and_items(Reader r, const char* what, Plan* p) {
  p->rank = r.getRank();
  FERRY_RETURN_IF_ERROR(read_rank(p->rank, what));
  for (auto item : r.getItems()) {
    FERRY_ASSIGN_OR_RETURN(PlanItem it, read_item(item, p->items.size()));
    p->items.push_back(std::move(it));
  }
  return Status();
}

Result<LocalSavePlan> read_local(proto::LocalPlan::Reader r) {
  LocalSavePlan p;
  FERRY_RETURN_IF_ERROR(read_rank_and_items(r, "local plan", &p));
  return p;
}

Result<SavePlan> read_rank_plan(proto::SavePlan::Reader r) {
  SavePlan p;
  FERRY_RETURN_IF_ERROR(read_rank_and_items(r, "save plan", &p));
  auto owners = r.getOwners();
  if (owners.size() != p.items.size())
    return Status::invalid_argument("save plan: " + std::to_string(owners.size()) +
                                    " owner lists for " + std::to_string(p.items.size()) +
                                    " items");
  for (auto o : owners) {
    std::vector<int32_t> ranks;
    for (int32_t x : o.getRanks()) {
      if (x < 0 || (!ranks.empty() && x <= ranks.back()))
        return Status::invalid_argument("save plan: item " + std::to_string(p.owners.size()) + " " +
                                        quote_value(p.items[p.owners.size()].key) +
                                        ": owner rank " + std::to_string(x) +
                                        " is negative or out of ascending order");
      ranks.push_back(x);
    }
    p.owners.push_back(std::move(ranks));
  }
  for (auto f : r.getFiles()) {
    std::string name = str(f);
    if (name.empty() || name.find('/') != std::string::npos || name.find('\0') != std::string::npos)
      return Status::invalid_argument("save plan: file " + std::to_string(p.files.size()) + " " +
                                      quote_value(name) + " is not a file name");
    p.files.push_back(std::move(name));
  }
  uint64_t total = 0;
  for (auto w : r.getWrites()) {
    PlannedWrite wr;
    wr.item = w.getItem();
    wr.offsets = i64s(w.getBox().getOffsets());
    wr.sizes = i64s(w.getBox().getSizes());
    wr.nbytes = w.getNbytes();
    wr.file = w.getFile();
    const std::string where = "save plan: write " + std::to_string(p.writes.size());
    if (wr.item >= p.items.size())
      return Status::invalid_argument(where + " names item " + std::to_string(wr.item) + " of " +
                                      std::to_string(p.items.size()));
    if (wr.file >= p.files.size())
      return Status::invalid_argument(where + " names file " + std::to_string(wr.file) + " of " +
                                      std::to_string(p.files.size()));
    const PlanItem& it = p.items[wr.item];
    FERRY_RETURN_IF_ERROR(
        check_inside(wr.offsets, wr.sizes, it.offsets, it.sizes, where,
                     "item " + std::to_string(wr.item) + " " + quote_value(it.key) + "'s region"));
    FERRY_RETURN_IF_ERROR(check_nbytes(wr.sizes, it.dtype, wr.nbytes, where));
    // Each write lies inside its item and so holds less than 2^63 bytes.
    if (__builtin_add_overflow(total, wr.nbytes, &total))
      return Status::invalid_argument("save plan: the writes' bytes overflow");
    p.writes.push_back(std::move(wr));
  }
  p.bytes = r.getBytes();
  if (p.bytes != total)
    return Status::invalid_argument("save plan: bytes " + std::to_string(p.bytes) +
                                    ", its writes hold " + std::to_string(total));
  return p;
}

// The magic, then the message, whose root `read` turns into a T. Every way
// the bytes can be wrong ends in a Status naming `what`.
template <class Root, class T, class Read>
Result<T> decode(const std::string& bytes, const char* magic, const char* what, Read read) {
  const std::string w(what);
  if (bytes.size() < kMagicBytes || bytes.compare(0, kMagicBytes, magic) != 0) {
    if (const char* other = kind_of(bytes))
      return Status::invalid_argument(w + ": these are the bytes of a " + other + ", not of a " +
                                      w + " (bad magic)");
    return Status::invalid_argument(w + ": not a Ferry " + w + " (bad magic: expected \"" + magic +
                                    "\")");
  }
  const size_t payload = bytes.size() - kMagicBytes;
  if (payload == 0 || payload % sizeof(capnp::word) != 0)
    return Status::invalid_argument(w + ": truncated: " + std::to_string(payload) +
                                    " bytes after the magic, not a whole number of 8-byte words");
  try {
    kj::Array<capnp::word> words = capnp_util::aligned_words(bytes.data() + kMagicBytes, payload);
    capnp::FlatArrayMessageReader reader(words.asPtr(),
                                         capnp_util::bounded_options(words.size(), 1024));
    if (reader.getEnd() != words.end())
      return Status::invalid_argument(
          w + ": " + std::to_string((words.end() - reader.getEnd()) * sizeof(capnp::word)) +
          " bytes after the end of the message");
    Result<T> out = read(reader.template getRoot<Root>());
    if (!out.ok()) return out.status().with_context(w + ": ");
    return out;
  } catch (const kj::Exception& e) {
    const std::string d = e.getDescription().cStr();
    const bool cut =
        d.find("prematurely") != std::string::npos || d.find("out-of-bounds") != std::string::npos;
    return Status::invalid_argument(w + (cut ? ": truncated: " : ": malformed: ") + d);
  } catch (const std::bad_alloc&) {
    return Status::internal("out of memory decoding a " + std::to_string(bytes.size()) + "-byte " +
                            w);
  } catch (const std::exception& e) {
    return Status::invalid_argument(w + ": malformed: " + e.what());
  }
}

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

Result<std::vector<SavePlan>> save_plans(const std::vector<LocalPlan>& locals, const GlobalPlan& gp,
                                         const std::vector<DataFileOptions>& files) {
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
    const DataFileOptions fo =
        static_cast<size_t>(rp.rank) < files.size() ? files[rp.rank] : DataFileOptions{};
    FERRY_ASSIGN_OR_RETURN(auto planned, data_files(local, rp, fo));
    for (PlannedFile& f : planned) {
      const auto file = static_cast<uint32_t>(sp.files.size());
      for (FileSlice& s : f.slices) {
        const uint64_t n =
            static_cast<uint64_t>(s.box.numel()) * dtype_size(local.items[s.item].dtype);
        sp.writes.push_back({s.item, std::move(s.box.offsets), std::move(s.box.sizes), n, file});
        sp.bytes += n;
      }
      sp.files.push_back(std::move(f.name));
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
  return framed<proto::LocalPlan>(kLocalMagic, [this](auto b) { set_local(b, *this); });
}

Result<LocalSavePlan> LocalSavePlan::from_bytes(const std::string& bytes) {
  return decode<proto::LocalPlan, LocalSavePlan>(bytes, kLocalMagic, "local plan", read_local);
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
  return framed<proto::SavePlan>(kRankMagic, [this](auto b) { set_rank_plan(b, *this); });
}

Result<SavePlan> SavePlan::from_bytes(const std::string& bytes) {
  return decode<proto::SavePlan, SavePlan>(bytes, kRankMagic, "save plan", read_rank_plan);
}

std::string encode_save_plans(const std::vector<SavePlan>& plans) {
  return framed<proto::SavePlanList>(kListMagic, [&plans](auto b) {
    auto list = b.initPlans(static_cast<unsigned>(plans.size()));
    for (size_t i = 0; i < plans.size(); ++i)
      set_rank_plan(list[static_cast<unsigned>(i)], plans[i]);
  });
}

Result<std::vector<SavePlan>> decode_save_plans(const std::string& bytes) {
  return decode<proto::SavePlanList, std::vector<SavePlan>>(
      bytes, kListMagic, "global plan",
      [](proto::SavePlanList::Reader r) -> Result<std::vector<SavePlan>> {
        std::vector<SavePlan> out;
        for (auto p : r.getPlans()) {
          auto sp = read_rank_plan(p);
          if (!sp.ok())
            return sp.status().with_context("rank " + std::to_string(out.size()) + "'s ");
          if (sp->rank != static_cast<int32_t>(out.size()))
            return Status::invalid_argument("plan " + std::to_string(out.size()) + " is rank " +
                                            std::to_string(sp->rank) + "'s");
          out.push_back(std::move(sp).value());
        }
        return out;
      });
}

namespace plan {

Result<std::vector<SavePlan>> global_plan(const std::vector<LocalSavePlan>& local_plans,
                                          OwnerPolicy policy, const SaveOptions& files) {
  // Defaults rather than a configuration: a plan with no job reads no config.
  FERRY_ASSIGN_OR_RETURN(DataFileOptions fo, resolve_data_files(Options{}, files, false));
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
  return save_plans(locals, gp, std::vector<DataFileOptions>(locals.size(), fo));
}

Result<LocalSavePlan> local_plan(const StateDict& sd, int32_t rank) {
  FERRY_ASSIGN_OR_RETURN(LocalPlan p, make_local_plan(sd, rank));
  return to_public(p);
}

}  // namespace plan

}  // namespace ferry
