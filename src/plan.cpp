#include "plan.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <string_view>
#include <unordered_map>

#include "checksum.hpp"

namespace ferry {

namespace {

int64_t numel_of(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

// Little-endian byte stream, so a digest means the same thing on every host.
// Hashed as it goes through a small buffer: the digest of a plan of 100,000
// items neither grows a buffer of megabytes nor faults one in, every save.
class Canonical {
 public:
  void u8(uint8_t v) {
    if (n_ == sizeof(buf_)) flush();
    buf_[n_++] = static_cast<char>(v);
  }
  void u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) u8(static_cast<uint8_t>(v >> (8 * i)));
  }
  void u64(uint64_t v) {
    if (sizeof(buf_) - n_ < 8) flush();
    for (int i = 0; i < 8; ++i) buf_[n_++] = static_cast<char>(v >> (8 * i));
  }
  void str(const std::string& s) {
    u64(s.size());
    for (size_t at = 0; at < s.size();) {
      if (n_ == sizeof(buf_)) flush();
      const size_t take = std::min(s.size() - at, sizeof(buf_) - n_);
      std::memcpy(buf_ + n_, s.data() + at, take);
      n_ += take;
      at += take;
    }
  }
  void dims(const std::vector<int64_t>& v) {
    u32(static_cast<uint32_t>(v.size()));
    for (int64_t x : v) u64(static_cast<uint64_t>(x));
  }
  uint64_t digest() {
    flush();
    return sum_.digest();
  }

 private:
  void flush() {
    sum_.update(buf_, n_);
    n_ = 0;
  }
  StreamingChecksum sum_;
  char buf_[16384];
  size_t n_ = 0;
};

}  // namespace

uint64_t LocalPlan::digest() const {
  Canonical c;
  c.str("ferry.local_plan.v1");
  c.u32(static_cast<uint32_t>(rank));
  c.u64(items.size());
  for (const auto& it : items) {
    c.str(it.key);
    c.u8(static_cast<uint8_t>(it.dtype));
    c.dims(it.global_shape);
    c.dims(it.box.offsets);
    c.dims(it.box.sizes);
    c.u64(it.nbytes);
  }
  return c.digest();
}

Result<LocalPlan> make_local_plan(const StateDict& sd, int32_t rank) {
  LocalPlan plan;
  FERRY_RETURN_IF_ERROR(make_local_plan_into(sd, rank, &plan));
  return plan;
}

namespace {

// dst = src, and false when that changed dst.
template <class T>
bool keep(T& dst, const T& src) {
  if (dst == src) return true;
  dst = src;
  return false;
}

// Dims are a few values: compared inline, not through a memcmp call each.
bool keep(std::vector<int64_t>& dst, const std::vector<int64_t>& src) {
  bool same = dst.size() == src.size();
  for (size_t i = 0; same && i < src.size(); ++i) same = dst[i] == src[i];
  if (!same) dst = src;
  return same;
}

bool all_zero(const std::vector<int64_t>& v, size_t n) {
  if (v.size() != n) return false;
  for (int64_t x : v)
    if (x != 0) return false;
  return true;
}

}  // namespace

Status make_local_plan_into(const StateDict& sd, int32_t rank, LocalPlan* out, bool* unchanged) {
  if (rank < 0) return Status::invalid_argument("rank " + std::to_string(rank) + " is negative");
  if (sd.size() > std::numeric_limits<uint32_t>::max())
    return Status::invalid_argument("state dict has too many entries");
  LocalPlan& plan = *out;
  // Compared as they are assigned: a repeated save's plan is known to be
  // the last one without hashing it again.
  bool same = plan.rank == rank && plan.items.size() == sd.size();
  plan.rank = rank;
  plan.items.resize(sd.size());
  uint32_t index = 0;
  for (const auto& e : sd.entries()) {
    FERRY_RETURN_IF_ERROR(validate_entry(e));
    // Assigned field by field: a kept item reuses its strings' and vectors' memory.
    WriteItem& it = plan.items[index];
    if (e.per_rank) {
      // Its own key: never a replica of another rank's.
      same = keep(it.key, per_rank_key(e.key, rank)) && same;
    } else if (parse_per_rank_key(e.key)) {
      return Status::invalid_argument("tensor '" + e.key +
                                      "': keys ending in @rank<N> are reserved for the values of "
                                      "per-rank entries; rename it, or add it as per-rank");
    } else {
      same = keep(it.key, e.key) && same;
    }
    same = keep(it.dtype, e.view.dtype) && same;
    same = keep(it.box.sizes, e.view.shape) && same;
    if (e.shard) {
      same = keep(it.global_shape, e.shard->global_shape) && same;
      same = keep(it.box.offsets, e.shard->offsets) && same;
    } else {
      same = keep(it.global_shape, e.view.shape) && same;
      if (!all_zero(it.box.offsets, e.view.shape.size())) {
        it.box.offsets.assign(e.view.shape.size(), 0);
        same = false;
      }
    }
    same = keep(it.nbytes, e.view.nbytes()) && same;
    same = keep(it.entry, index++) && same;
  }
  if (unchanged) *unchanged = same;
  return Status();
}

namespace {

constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
constexpr uint32_t kWhole = kNone - 1;

// How the non-empty boxes of a key lie, as far as intern() has seen them in
// rank order. `whole` and `chain` prove that the boxes tile the tensor with
// nothing to sort or check; `other` sends the key through group_key.
enum class Layout : uint8_t {
  none,   // no non-empty box yet
  whole,  // each box is the whole tensor: one replica group
  chain,  // the boxes abut along one dimension and span the others: no replicas
  other,
};

struct KeyInfo {
  std::string_view key;
  const WriteItem* first;  // fixes the dtype and global shape of the key
  const int64_t* global;   // first->global_shape.data(), one load nearer
  DType dtype;
  Layout layout;
  uint32_t first_rank;
  uint32_t last_rank;  // catches a key listed twice by one rank
  uint32_t count;
  uint32_t ndim;
  uint32_t holders;  // items with a non-empty box (whole and chain only)
  uint32_t along;    // chain: the dimension the boxes cut
  int64_t next;      // chain: where the next box must start along it
  uint64_t dsize;
  int64_t global_numel;
  uint32_t begin;   // group_general: the key's first slot; place: its next member
  size_t box_base;  // group_general: where its boxes start
};

// One item of one rank, as the coordinator sees it while grouping.
struct Slot {
  uint32_t rank;
  uint32_t index;  // into plans[rank].items
};

// The items of one key side by side: their slots, and their boxes stored flat
// (offsets then sizes, `width` = 2 * ndim int64 per box) so that comparing two
// rows orders boxes by offsets, then sizes.
struct KeyItems {
  Slot* slots;
  int64_t* boxes;
  size_t width;
  const int64_t* box(uint32_t j) const { return boxes + j * width; }
};

// A replica group held by several ranks: members_[begin, end), ascending rank.
struct Group {
  uint32_t begin;
  uint32_t end;
  int64_t rows;  // the box's dim-0 size (0 for a 0-d tensor): what a split cuts
  uint64_t nbytes;
  uint32_t key;  // with the group's index, a key's groups in box order: the tie-break
  size_t box;    // its box in group_boxes_ (offsets, then sizes)
};

struct Slice {
  int64_t begin;  // rows from the item's dim-0 offset
  int64_t rows;
  uint32_t group;
};

// Keys run to a few dozen bytes and almost always match: comparing them a word
// at a time inline beats a call to memcmp, which dominated the walk.
uint64_t load_u64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

bool same_key(std::string_view a, std::string_view b) {
  const size_t n = a.size();
  if (n != b.size()) return false;
  const char* x = a.data();
  const char* y = b.data();
  if (n < 8) {
    for (size_t i = 0; i < n; ++i)
      if (x[i] != y[i]) return false;
    return true;
  }
  uint64_t diff = 0;
  for (size_t i = 0; i + 8 <= n; i += 8) diff |= load_u64(x + i) ^ load_u64(y + i);
  diff |= load_u64(x + n - 8) ^ load_u64(y + n - 8);  // the tail, overlapping
  return diff == 0;
}

bool same_dims(const std::vector<int64_t>& v, const int64_t* want, size_t n) {
  if (v.size() != n) return false;
  const int64_t* p = v.data();
  for (size_t d = 0; d < n; ++d)
    if (p[d] != want[d]) return false;
  return true;
}

int cmp_row(const int64_t* a, const int64_t* b, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return a[i] < b[i] ? -1 : 1;
  return 0;
}

// Boxes have a handful of dims: a plain loop beats a call to memcpy.
void copy_row(int64_t* dst, const int64_t* src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = src[i];
}

int64_t row_numel(const int64_t* sizes, size_t ndim) {
  int64_t n = 1;
  for (size_t d = 0; d < ndim; ++d) n *= sizes[d];
  return n;
}

// The whole of make_global_plan, in passes:
//   intern: one walk over every item of every rank (the only one that reads
//           the WriteItems' heap data): key ids, validation, boxes copied into
//           fbox_, a flat int64 array in rank order, and each key's layout.
//   place:  the keys whose layout intern() recognised (replicated, or sharded
//           along one dimension in rank order: most of them) in one walk over
//           fbox_; no sort, no cover check.
//   group:  per other key, its items side by side sorted by box: replica
//           groups, and the check that distinct boxes tile the tensor.
//   Groups held by one rank are assigned as soon as they are found.
//   assign: replicated groups, by the policy.
//   emit:   one walk in rank order building the RankPlans; only split chunks
//           get a box of their own (a slice of their group's).
// Scratch vectors are reused across keys, so the per-key work allocates
// nothing once they have grown.
class GlobalPlanner {
 public:
  GlobalPlanner(const std::vector<LocalPlan>& plans, const GlobalPlanOptions& opts)
      : plans_(plans), opts_(opts) {}

  Result<GlobalPlan> run() {
    if (plans_.empty()) return Status::invalid_argument("global plan needs at least one rank");
    if (opts_.files_per_rank == 0) return Status::invalid_argument("files_per_rank must be >= 1");
    FERRY_RETURN_IF_ERROR(intern());
    assign_.assign(base_.back(), kNone);
    chunks_of_.assign(plans_.size(), 0);
    load_.assign(plans_.size(), 0);
    place();
    FERRY_RETURN_IF_ERROR(uniform_ ? group_uniform() : group_general());
    if (opts_.policy == OwnerPolicy::lowest_rank)
      assign_lowest();
    else
      assign_balanced();
    return emit();
  }

 private:
  Status item_error(uint32_t rank, const WriteItem& it, const std::string& why) const {
    return Status::invalid_argument("tensor '" + it.key + "' on rank " + std::to_string(rank) +
                                    ": " + why);
  }

  // The first item of a key fixes its dtype and global shape.
  Status init_key(uint32_t rank, const WriteItem& it, KeyInfo* k) const {
    k->dsize = dtype_size(it.dtype);
    if (k->dsize == 0) return item_error(rank, it, "unknown dtype");
    int64_t n = 1;
    for (int64_t s : it.global_shape) {
      if (s < 0)
        return item_error(rank, it, "negative global shape " + shape_to_string(it.global_shape));
      if (s != 0 && n > std::numeric_limits<int64_t>::max() / 8 / s)
        return item_error(rank, it, "global shape too large " + shape_to_string(it.global_shape));
      n *= s;
    }
    k->ndim = static_cast<uint32_t>(it.global_shape.size());
    k->global_numel = n;
    return Status();
  }

  // REQUIRES: `it` has its key's dtype and global shape. The numel of a box
  // inside the global shape cannot overflow: init_key bounded the global one.
  static bool box_ok(const WriteItem& it, const KeyInfo& k) {
    const size_t n = k.ndim;
    if (it.box.offsets.size() != n || it.box.sizes.size() != n) return false;
    const int64_t* o = it.box.offsets.data();
    const int64_t* s = it.box.sizes.data();
    const int64_t* g = k.global;
    int64_t numel = 1;
    for (size_t d = 0; d < n; ++d) {
      if (o[d] < 0 || s[d] < 0 || o[d] > g[d] || s[d] > g[d] - o[d]) return false;
      numel *= s[d];
    }
    return it.nbytes == static_cast<uint64_t>(numel) * k.dsize;
  }

  Status box_error(uint32_t rank, const WriteItem& it, const KeyInfo& k) const {
    const size_t n = k.ndim;
    if (it.box.offsets.size() != n || it.box.sizes.size() != n)
      return item_error(rank, it,
                        "box rank (offsets " + std::to_string(it.box.offsets.size()) + ", sizes " +
                            std::to_string(it.box.sizes.size()) + ") differs from global rank " +
                            std::to_string(n));
    for (size_t d = 0; d < n; ++d) {
      const int64_t o = it.box.offsets[d], s = it.box.sizes[d], g = it.global_shape[d];
      if (o < 0 || s < 0 || o > g || s > g - o)
        return item_error(rank, it,
                          "box " + it.box.to_string() + " is outside global shape " +
                              shape_to_string(it.global_shape));
    }
    const uint64_t want = static_cast<uint64_t>(numel_of(it.box.sizes)) * k.dsize;
    return item_error(rank, it,
                      "nbytes " + std::to_string(it.nbytes) + " but box " + it.box.to_string() +
                          " of " + dtype_name(it.dtype) + " holds " + std::to_string(want));
  }

  // Asks for the WriteItem a few items ahead, and for the heap buffers of a
  // nearer one (whose WriteItem is by then in cache): the walk is bound by the
  // latency of those dependent loads, not by bandwidth.
  static void prefetch(const std::vector<WriteItem>& items, size_t i) {
    if (i + 16 < items.size()) {
      const char* p = reinterpret_cast<const char*>(&items[i + 16]);
      __builtin_prefetch(p);
      __builtin_prefetch(p + 64);
    }
    if (i + 6 < items.size()) {
      const WriteItem& f = items[i + 6];
      __builtin_prefetch(f.key.data());
      __builtin_prefetch(f.global_shape.data());
      __builtin_prefetch(f.box.offsets.data());
      __builtin_prefetch(f.box.sizes.data());
    }
  }

  // Follows the layout of a key as its boxes arrive in rank order (see
  // Layout). Empty boxes are passed over: they hold nothing, and group_key
  // passes over them too. The key's tensor is not empty (else it is `other`),
  // so a box that spans a dimension is not empty in it. Called for every item
  // while intern() waits on memory: the usual case, a box that continues its
  // key's layout, is a few compares without branches.
  static void track(KeyInfo* k, const int64_t* box) {
    const size_t nd = k->ndim;
    const int64_t* g = k->global;
    if (k->layout == Layout::chain) {
      const size_t a = k->along;
      int64_t diff = box[a] ^ k->next;
      for (size_t d = 0; d < nd; ++d)
        if (d != a) diff |= box[d] | (box[nd + d] ^ g[d]);
      if (diff == 0) {  // the next link, or an empty box where it would start
        k->next += box[nd + a];
        k->holders += box[nd + a] != 0;
        return;
      }
    } else if (k->layout == Layout::whole) {
      int64_t diff = 0;
      for (size_t d = 0; d < nd; ++d) diff |= box[d] | (box[nd + d] ^ g[d]);
      if (diff == 0) {
        k->holders++;
        return;
      }
    } else if (k->layout == Layout::other) {
      return;
    }
    track_rest(k, box);
  }

  // track(): a key's first non-empty box, empty boxes, and boxes that end a
  // layout.
  static void track_rest(KeyInfo* k, const int64_t* box) {
    const size_t nd = k->ndim;
    const int64_t* g = k->global;
    size_t cut = nd, cuts = 0;  // the dimensions the box does not span
    for (size_t d = 0; d < nd; ++d) {
      if (box[nd + d] == 0) return;  // empty
      if (box[d] != 0 || box[nd + d] != g[d]) {
        if (cuts++ == 0) cut = d;
      }
    }
    if (k->layout != Layout::none) {
      k->layout = Layout::other;
    } else if (cuts == 0) {
      k->layout = Layout::whole;
      k->holders = 1;
    } else if (cuts == 1 && box[cut] == 0) {
      k->layout = Layout::chain;
      k->along = static_cast<uint32_t>(cut);
      k->next = box[nd + cut];
      k->holders = 1;
    } else {
      k->layout = Layout::other;
    }
  }

  // Gives every key a dense id in order of first appearance, checks each item
  // against its key and copies its box into fbox_. Ranks usually list the same
  // keys in the same order, so the id found at the same position on the
  // previous rank is tried before the hash map: one string compare per item.
  Status intern() {
    const size_t nranks = plans_.size();
    if (nranks >= kWhole) return Status::invalid_argument("too many ranks");
    base_.resize(nranks + 1);
    size_t total = 0, widest = 0;
    for (size_t r = 0; r < nranks; ++r) {
      if (plans_[r].rank != static_cast<int32_t>(r))
        return Status::invalid_argument("local plan at position " + std::to_string(r) +
                                        " is for rank " + std::to_string(plans_[r].rank));
      base_[r] = total;
      total += plans_[r].items.size();
      widest = std::max(widest, plans_[r].items.size());
    }
    base_[nranks] = total;
    if (total >= kWhole) return Status::invalid_argument("too many write items");
    uniform_ = total == widest * nranks;
    key_of_.reset(new uint32_t[total]);
    fbox_cap_ = total * 4;  // enough for 2-d tensors; grows for more
    fbox_.reset(new int64_t[fbox_cap_]);
    fbox_len_ = 0;
    std::vector<uint32_t> prev(widest, kNone);
    for (uint32_t r = 0; r < nranks; ++r) {
      const auto& items = plans_[r].items;
      uint32_t* key_of = key_of_.get() + base_[r];
      for (size_t i = 0; i < items.size(); ++i) {
        prefetch(items, i);
        const WriteItem& it = items[i];
        const std::string_view name(it.key);
        uint32_t id = prev[i];
        if (id == kNone || !same_key(keys_[id].key, name)) {
          auto found = ids_.find(name);
          id = found == ids_.end() ? kNone : found->second;
        }
        if (id == kNone) {
          KeyInfo k{};
          k.key = name;
          k.first = &it;
          k.global = it.global_shape.data();
          k.dtype = it.dtype;
          k.first_rank = k.last_rank = r;
          FERRY_RETURN_IF_ERROR(init_key(r, it, &k));
          // A zero-size tensor still gets one chunk: group_key knows how.
          k.layout = k.global_numel == 0 ? Layout::other : Layout::none;
          id = static_cast<uint32_t>(keys_.size());
          keys_.push_back(k);
          ids_.emplace(name, id);
        } else {
          KeyInfo& k = keys_[id];
          if (k.last_rank == r)
            return Status::invalid_argument("rank " + std::to_string(r) + " lists tensor '" +
                                            it.key + "' twice");
          k.last_rank = r;
          if (it.dtype != k.dtype || !same_dims(it.global_shape, k.global, k.ndim))
            return Status::invalid_argument(
                "tensor '" + it.key + "': rank " + std::to_string(k.first_rank) + " has " +
                dtype_name(k.first->dtype) + " " + shape_to_string(k.first->global_shape) +
                ", rank " + std::to_string(r) + " has " + dtype_name(it.dtype) + " " +
                shape_to_string(it.global_shape));
        }
        KeyInfo& k = keys_[id];
        if (!box_ok(it, k)) return box_error(r, it, k);
        if (fbox_len_ + 2 * k.ndim > fbox_cap_) grow_fbox(2 * k.ndim);
        int64_t* row = fbox_.get() + fbox_len_;
        copy_row(row, it.box.offsets.data(), k.ndim);
        copy_row(row + k.ndim, it.box.sizes.data(), k.ndim);
        fbox_len_ += 2 * k.ndim;
        track(&k, row);
        k.count++;
        key_of[i] = id;
        prev[i] = id;
        uniform_ &= id == i;
      }
    }
    return Status();
  }

  void grow_fbox(size_t need) {
    fbox_cap_ = std::max(2 * fbox_cap_, fbox_len_ + need);
    std::unique_ptr<int64_t[]> bigger(new int64_t[fbox_cap_]);
    std::memcpy(bigger.get(), fbox_.get(), fbox_len_ * sizeof(int64_t));
    fbox_ = std::move(bigger);
  }

  // Settles the keys whose layout intern() recognised: a chain must end at
  // the tensor's end (else it leaves a gap: `other` then finds and names it).
  // Whole copies held by several ranks become one replica group, members in
  // ascending rank; every other non-empty box is a group of its own and is
  // given to its rank at once. Groups are numbered in key order, as group_key
  // numbers them, so that the order of their ties does not depend on which
  // pass found them.
  void place() {
    for (uint32_t kid = 0; kid < keys_.size(); ++kid) {
      KeyInfo& k = keys_[kid];
      if (k.layout == Layout::none || (k.layout == Layout::chain && k.next != k.global[k.along]))
        k.layout = Layout::other;
      if (k.layout == Layout::other) {
        slow_.push_back(kid);
        continue;
      }
      if (k.layout == Layout::whole && k.holders >= 2) {
        k.begin = static_cast<uint32_t>(members_.size());
        groups_.push_back({k.begin, k.begin + k.holders, k.ndim >= 1 ? k.global[0] : 0,
                           static_cast<uint64_t>(k.global_numel) * k.dsize, kid,
                           group_boxes_.size()});
        group_boxes_.insert(group_boxes_.end(), k.ndim, 0);
        group_boxes_.insert(group_boxes_.end(), k.global, k.global + k.ndim);
        members_.resize(members_.size() + k.holders);
        unique_items_ += 1;
      } else {
        unique_items_ += k.holders;
      }
    }
    if (slow_.size() == keys_.size()) return;
    const int64_t* box = fbox_.get();
    for (uint32_t r = 0; r < plans_.size(); ++r) {
      const uint32_t n = static_cast<uint32_t>(plans_[r].items.size());
      const uint32_t* key_of = key_of_.get() + base_[r];
      for (uint32_t i = 0; i < n; ++i) {
        KeyInfo& k = keys_[key_of[i]];
        const int64_t* row = box;
        box += 2 * k.ndim;
        if (k.layout == Layout::other) continue;
        const int64_t numel = row_numel(row + k.ndim, k.ndim);
        if (numel == 0) continue;
        if (k.layout == Layout::whole && k.holders >= 2)
          members_[k.begin++] = {r, i};
        else
          give({r, i}, kWhole, static_cast<uint64_t>(numel) * k.dsize);
      }
    }
  }

  // Any layout: a counting sort of the other keys' items by key (stable, so
  // each key's slots come out in ascending rank) with their boxes, then each
  // of those keys.
  Status group_general() {
    if (slow_.empty()) return Status();
    uint32_t pos = 0;
    size_t box = 0;
    for (uint32_t kid : slow_) {
      KeyInfo& k = keys_[kid];
      k.begin = pos;
      k.box_base = box;
      pos += k.count;
      box += static_cast<size_t>(k.count) * 2 * k.ndim;
    }
    std::unique_ptr<Slot[]> slots(new Slot[pos]);
    std::unique_ptr<int64_t[]> kbox(new int64_t[box]);
    std::vector<uint32_t> next(keys_.size());
    std::vector<int64_t*> next_box(keys_.size());
    for (uint32_t kid : slow_) {
      next[kid] = keys_[kid].begin;
      next_box[kid] = kbox.get() + keys_[kid].box_base;
    }
    const int64_t* src = fbox_.get();
    for (uint32_t r = 0; r < plans_.size(); ++r) {
      const uint32_t n = static_cast<uint32_t>(plans_[r].items.size());
      const uint32_t* key_of = key_of_.get() + base_[r];
      for (uint32_t i = 0; i < n; ++i) {
        const uint32_t k = key_of[i];
        const size_t width = 2 * keys_[k].ndim;
        if (keys_[k].layout == Layout::other) {
          slots[next[k]++] = {r, i};
          copy_row(next_box[k], src, width);
          next_box[k] += width;
        }
        src += width;
      }
    }
    for (uint32_t kid : slow_) {
      const KeyInfo& key = keys_[kid];
      KeyItems v{slots.get() + key.begin, kbox.get() + key.box_base, 2 * key.ndim};
      FERRY_RETURN_IF_ERROR(group_key(kid, v));
    }
    return Status();
  }

  // Every rank lists the same keys in the same order (item i is key i), so
  // fbox_ is a ranks x keys matrix of boxes. The other keys' columns are
  // transposed a block of keys at a time into a buffer small enough to stay in
  // cache while those keys are grouped, instead of through a copy of
  // everything.
  Status group_uniform() {
    const uint32_t nranks = static_cast<uint32_t>(plans_.size());
    const uint32_t nkeys = static_cast<uint32_t>(keys_.size());
    std::vector<size_t> in_row(nkeys + 1);  // a key's box within a rank's row of fbox_
    for (uint32_t i = 0; i < nkeys; ++i) in_row[i + 1] = in_row[i] + 2 * keys_[i].ndim;
    const size_t row = in_row[nkeys];
    auto width = [&](uint32_t kid) { return in_row[kid + 1] - in_row[kid]; };
    constexpr size_t kBlockBytes = 1 << 20;
    constexpr uint32_t kRowsAhead = 4;
    const size_t slot_bytes = static_cast<size_t>(nranks) * sizeof(Slot);
    std::vector<size_t> in_block;  // a key's column within the block
    for (size_t kb = 0; kb < slow_.size();) {
      size_t ke = kb + 1;
      size_t bytes = slot_bytes + nranks * width(slow_[kb]) * sizeof(int64_t);
      while (ke < slow_.size()) {
        const size_t more = slot_bytes + nranks * width(slow_[ke]) * sizeof(int64_t);
        if (bytes + more > kBlockBytes) break;
        bytes += more;
        ++ke;
      }
      in_block.assign(1, 0);
      for (size_t j = kb; j < ke; ++j) in_block.push_back(in_block.back() + width(slow_[j]));
      block_slots_.resize((ke - kb) * nranks);
      block_box_.resize(nranks * in_block.back());
      for (uint32_t r = 0; r < nranks; ++r) {
        const int64_t* src = fbox_.get() + r * row;
        if (r + kRowsAhead < nranks) {
          // Rows lie far apart: no hardware prefetcher follows this walk.
          const int64_t* ahead = src + kRowsAhead * row;
          for (size_t j = kb; j < ke; ++j) {
            const uint32_t kid = slow_[j];
            __builtin_prefetch(ahead + in_row[kid]);
            __builtin_prefetch(ahead + in_row[kid + 1] - 1);
          }
        }
        for (size_t j = kb; j < ke; ++j) {
          const uint32_t kid = slow_[j];
          const size_t w = width(kid);
          block_slots_[(j - kb) * nranks + r] = {r, kid};
          copy_row(block_box_.data() + nranks * in_block[j - kb] + r * w, src + in_row[kid], w);
        }
      }
      for (size_t j = kb; j < ke; ++j) {
        KeyItems v{block_slots_.data() + (j - kb) * nranks,
                   block_box_.data() + nranks * in_block[j - kb], width(slow_[j])};
        FERRY_RETURN_IF_ERROR(group_key(slow_[j], v));
      }
      kb = ke;
    }
    return Status();
  }

  // Orders a key's items by box, then rank.
  void sort_key(const KeyInfo& k, const KeyItems& v) {
    const size_t width = v.width;
    const uint32_t n = k.count;
    perm_.resize(n);
    for (uint32_t i = 0; i < n; ++i) perm_[i] = i;
    std::sort(perm_.begin(), perm_.end(), [&](uint32_t a, uint32_t b) {
      const int c = cmp_row(v.box(a), v.box(b), width);
      return c != 0 ? c < 0 : v.slots[a].rank < v.slots[b].rank;
    });
    tmp_slots_.assign(v.slots, v.slots + n);
    tmp_box_.assign(v.boxes, v.boxes + n * width);
    for (uint32_t i = 0; i < n; ++i) {
      v.slots[i] = tmp_slots_[perm_[i]];
      copy_row(v.boxes + i * width, tmp_box_.data() + perm_[i] * width, width);
    }
  }

  Status group_key(uint32_t kid, const KeyItems& v) {
    const KeyInfo& k = keys_[kid];
    const uint32_t n = k.count;
    // Row-, column- and grid-sharded plans usually arrive sorted (ranks are
    // laid out in box order), so the sort is usually skipped.
    for (uint32_t j = 1; j < n; ++j) {
      if (cmp_row(v.box(j - 1), v.box(j), v.width) > 0) {
        sort_key(k, v);
        break;
      }
    }
    distinct_.clear();
    for (uint32_t g = 0; g < n;) {
      const int64_t* box = v.box(g);
      uint32_t ge = g + 1;
      while (ge < n && cmp_row(box, v.box(ge), v.width) == 0) ++ge;
      const int64_t numel = row_numel(box + k.ndim, k.ndim);
      // A zero-size tensor is written once (its first group) so that the
      // manifest still lists it; empty shards of other tensors hold nothing.
      if (k.global_numel == 0 ? g == 0 : numel != 0) {
        add_group(kid, v, g, ge, static_cast<uint64_t>(numel) * k.dsize);
        if (k.global_numel != 0) distinct_.push_back(g);
      }
      g = ge;
    }
    if (k.global_numel == 0) return Status();
    if (chain_covers(k, v)) return Status();
    return check_cover(k, v);
  }

  // A group held by one rank can only go to that rank, whatever the policy:
  // it is assigned at once. Replicated groups wait for the policy.
  void add_group(uint32_t kid, const KeyItems& v, uint32_t begin, uint32_t end, uint64_t nbytes) {
    const KeyInfo& k = keys_[kid];
    unique_items_++;
    if (end - begin == 1) {
      give(v.slots[begin], kWhole, nbytes);
      return;
    }
    const int64_t rows = k.ndim >= 1 ? v.box(begin)[k.ndim] : 0;
    groups_.push_back({static_cast<uint32_t>(members_.size()),
                       static_cast<uint32_t>(members_.size() + end - begin), rows, nbytes, kid,
                       group_boxes_.size()});
    group_boxes_.insert(group_boxes_.end(), v.box(begin), v.box(begin) + v.width);
    members_.insert(members_.end(), v.slots + begin, v.slots + end);
  }

  // The common shardings in one pass: every box spans the whole tensor but in
  // one dimension d, and the boxes (sorted, so by their offset in d) abut from
  // 0 to the end of d. Also the unsharded case: one box, the whole tensor.
  // False means "not shown", never "invalid": the general check decides.
  bool chain_covers(const KeyInfo& k, const KeyItems& v) const {
    if (distinct_.empty()) return false;
    const size_t nd = k.ndim;
    const int64_t* global = k.first->global_shape.data();
    auto full = [&](const int64_t* box, size_t d) {
      return box[d] == 0 && box[nd + d] == global[d];
    };
    const int64_t* first = v.box(distinct_[0]);
    size_t along = nd;
    for (size_t d = 0; d < nd; ++d) {
      if (full(first, d)) continue;
      if (along != nd) return false;
      along = d;
    }
    if (along == nd) return distinct_.size() == 1;
    int64_t expect = 0;
    for (uint32_t j : distinct_) {
      const int64_t* box = v.box(j);
      if (box[along] != expect) return false;
      for (size_t d = 0; d < nd; ++d)
        if (d != along && !full(box, d)) return false;
      expect = box[along] + box[nd + along];
    }
    return expect == global[along];
  }

  Status overlap_error(const KeyInfo& k, const KeyItems& v, uint32_t a, uint32_t b) const {
    return Status::invalid_argument("tensor '" + std::string(k.key) + "': rank " +
                                    std::to_string(v.slots[a].rank) + " box " +
                                    box_to_string(v.box(a), v.box(a) + k.ndim, k.ndim) +
                                    " overlaps rank " + std::to_string(v.slots[b].rank) + " box " +
                                    box_to_string(v.box(b), v.box(b) + k.ndim, k.ndim));
  }

  // The distinct non-empty boxes of a key (distinct_, sorted by offsets) must
  // tile the global shape: pairwise disjoint and covering every element.
  Status check_cover(const KeyInfo& k, const KeyItems& v) {
    const int64_t* global = k.first->global_shape.data();
    const size_t ndim = k.ndim;
    if (cuts_.size() < ndim) cuts_.resize(ndim);
    // Cut points per dimension: every box edge, plus 0 and the global end so
    // that gaps at the borders show up as unmarked cells.
    const uint64_t limit = 8 * static_cast<uint64_t>(distinct_.size()) + 64;
    uint64_t cells = 1;
    for (size_t d = 0; d < ndim; ++d) {
      lo_vals_.clear();
      hi_vals_.clear();
      lo_vals_.push_back(0);
      for (uint32_t j : distinct_) {
        const int64_t* box = v.box(j);
        lo_vals_.push_back(box[d]);
        hi_vals_.push_back(box[d] + box[ndim + d]);
      }
      hi_vals_.push_back(global[d]);
      if (!std::is_sorted(lo_vals_.begin(), lo_vals_.end()))
        std::sort(lo_vals_.begin(), lo_vals_.end());
      if (!std::is_sorted(hi_vals_.begin(), hi_vals_.end()))
        std::sort(hi_vals_.begin(), hi_vals_.end());
      auto& cut = cuts_[d];
      cut.resize(lo_vals_.size() + hi_vals_.size());
      cut.erase(std::set_union(lo_vals_.begin(), lo_vals_.end(), hi_vals_.begin(), hi_vals_.end(),
                               cut.begin()),
                cut.end());
      cut.erase(std::unique(cut.begin(), cut.end()), cut.end());
      const uint64_t n = cut.size() - 1;
      if (n > limit / cells) return check_cover_sweep(k, v);
      cells *= n;
    }
    return check_cover_grid(k, v, cells);
  }

  // Marks the grid cells each box covers with the box's index; a cell marked
  // twice is an overlap, a cell never marked a gap.
  Status check_cover_grid(const KeyInfo& k, const KeyItems& v, uint64_t cells) {
    const size_t ndim = k.ndim;
    mark_.assign(cells, kNone);
    lo_idx_.resize(ndim);
    hi_idx_.resize(ndim);
    cur_.resize(ndim);
    stride_.resize(ndim);
    uint64_t st = 1;
    for (size_t d = ndim; d-- > 0;) {
      stride_[d] = st;
      st *= cuts_[d].size() - 1;
    }
    size_t row_cursor = 0;  // boxes come sorted by dim-0 offset
    for (uint32_t j : distinct_) {
      const int64_t* box = v.box(j);
      for (size_t d = 0; d < ndim; ++d) {
        const auto& cut = cuts_[d];
        size_t lo;
        if (d == 0) {
          while (cut[row_cursor] < box[0]) ++row_cursor;
          lo = row_cursor;
        } else {
          lo = std::lower_bound(cut.begin(), cut.end(), box[d]) - cut.begin();
        }
        const int64_t end = box[d] + box[ndim + d];
        size_t hi = lo + 1;
        if (cut[hi] != end) hi = std::lower_bound(cut.begin() + hi, cut.end(), end) - cut.begin();
        lo_idx_[d] = lo;
        hi_idx_[d] = hi;
        cur_[d] = lo;
      }
      // Odometer over the cells of the box, last dimension fastest.
      for (bool more = true; more;) {
        uint64_t cell = 0;
        for (size_t d = 0; d < ndim; ++d) cell += cur_[d] * stride_[d];
        if (mark_[cell] != kNone) return overlap_error(k, v, mark_[cell], j);
        mark_[cell] = j;
        more = false;
        for (size_t d = ndim; d-- > 0;) {
          if (++cur_[d] < hi_idx_[d]) {
            more = true;
            break;
          }
          cur_[d] = lo_idx_[d];
        }
      }
    }
    for (uint64_t cell = 0; cell < cells; ++cell) {
      if (mark_[cell] != kNone) continue;
      std::string where = "[";
      uint64_t rest = cell;
      for (size_t d = 0; d < ndim; ++d) {
        const uint64_t c = rest / stride_[d];
        rest %= stride_[d];
        if (d) where += ", ";
        where += std::to_string(cuts_[d][c]) + ":" + std::to_string(cuts_[d][c + 1]);
      }
      return Status::invalid_argument("tensor '" + std::string(k.key) +
                                      "': no rank holds elements " + where + "] of global shape " +
                                      shape_to_string(k.first->global_shape));
    }
    return Status();
  }

  // For boxes that cut the tensor into too many grid cells: sweep along dim 0
  // keeping the boxes whose dim-0 range is still open, test each new box
  // against those, then compare volumes (disjoint boxes inside the tensor
  // cover it iff their volumes add up to its numel).
  Status check_cover_sweep(const KeyInfo& k, const KeyItems& v) {
    const size_t ndim = k.ndim;
    active_.clear();
    int64_t covered = 0;
    for (uint32_t j : distinct_) {
      const int64_t* box = v.box(j);
      size_t keep = 0;
      for (uint32_t a : active_) {
        const int64_t* ab = v.box(a);
        if (ab[0] + ab[ndim] > box[0]) active_[keep++] = a;
      }
      active_.resize(keep);
      for (uint32_t a : active_) {
        const int64_t* ab = v.box(a);
        bool meet = true;
        for (size_t d = 0; d < ndim && meet; ++d)
          meet = std::max(ab[d], box[d]) < std::min(ab[d] + ab[ndim + d], box[d] + box[ndim + d]);
        if (meet) return overlap_error(k, v, a, j);
      }
      active_.push_back(j);
      covered += row_numel(box + ndim, ndim);
    }
    if (covered != k.global_numel)
      return Status::invalid_argument("tensor '" + std::string(k.key) + "': ranks hold " +
                                      std::to_string(covered) + " of its " +
                                      std::to_string(k.global_numel) + " elements (global shape " +
                                      shape_to_string(k.first->global_shape) + ")");
    return Status();
  }

  // `what`: kWhole or a slice. A rank's bytes are the sum of what it is given.
  void give(const Slot& s, uint32_t what, uint64_t bytes) {
    assign_[base_[s.rank] + s.index] = what;
    chunks_of_[s.rank]++;
    load_[s.rank] += bytes;
  }

  void assign_lowest() {
    for (const Group& g : groups_) give(members_[g.begin], kWhole, g.nbytes);
  }

  // LPT greedy: the groups that only one rank holds have loaded their ranks
  // already (place, add_group); the replicated ones follow, largest first, each to
  // its least-loaded member, or in dim-0 slices to several of them when large.
  void assign_balanced() {
    std::vector<uint64_t>& load = load_;
    std::vector<uint32_t> order(groups_.size());
    for (uint32_t gi = 0; gi < groups_.size(); ++gi) order[gi] = gi;
    std::sort(order.begin(), order.end(), [this](uint32_t a, uint32_t b) {
      const Group& x = groups_[a];
      const Group& y = groups_[b];
      if (x.nbytes != y.nbytes) return x.nbytes > y.nbytes;
      if (x.key != y.key) return x.key < y.key;
      return a < b;
    });
    std::vector<uint32_t> pick;
    for (uint32_t gi : order) {
      const Group& g = groups_[gi];
      const uint32_t members = g.end - g.begin;
      const bool split = opts_.split_bytes > 0 && g.nbytes >= opts_.split_bytes && g.rows >= 2;
      if (!split) {
        uint32_t best = g.begin;
        for (uint32_t m = g.begin + 1; m < g.end; ++m)
          if (load[members_[m].rank] < load[members_[best].rank]) best = m;
        give(members_[best], kWhole, g.nbytes);
        continue;
      }
      const uint32_t parts = static_cast<uint32_t>(std::min<int64_t>(members, g.rows));
      pick.resize(members);
      for (uint32_t m = 0; m < members; ++m) pick[m] = g.begin + m;
      auto by_load = [this, &load](uint32_t a, uint32_t b) {
        const uint64_t la = load[members_[a].rank], lb = load[members_[b].rank];
        return la != lb ? la < lb : members_[a].rank < members_[b].rank;
      };
      // by_load is a total order (members are distinct ranks): either sort
      // picks the same parts. A full sort, the usual case, is the quicker.
      if (parts == members)
        std::sort(pick.begin(), pick.end(), by_load);
      else
        std::partial_sort(pick.begin(), pick.begin() + parts, pick.end(), by_load);
      const uint64_t row_bytes = g.nbytes / static_cast<uint64_t>(g.rows);
      const int64_t base = g.rows / parts, extra = g.rows % parts;
      int64_t begin = 0;
      for (uint32_t p = 0; p < parts; ++p) {
        const int64_t n = base + (p < extra ? 1 : 0);
        const Slot& s = members_[pick[p]];
        give(s, static_cast<uint32_t>(slices_.size()), static_cast<uint64_t>(n) * row_bytes);
        slices_.push_back({begin, n, gi});
        begin += n;
      }
    }
  }

  // Each rank holds one item per key and split slices go to distinct members,
  // so a rank writes at most one chunk per item: walking its items in order
  // yields its chunks already in write order.
  GlobalPlan emit() {
    GlobalPlan gp;
    gp.ranks.resize(plans_.size());
    gp.unique_items = unique_items_;
    for (uint32_t r = 0; r < plans_.size(); ++r) {
      RankPlan& rp = gp.ranks[r];
      rp.rank = static_cast<int32_t>(r);
      rp.files = opts_.files_per_rank;
      rp.bytes = load_[r];
      rp.chunks.reserve(chunks_of_[r]);
      const uint32_t n = static_cast<uint32_t>(plans_[r].items.size());
      const uint32_t* assign = assign_.data() + base_[r];
      for (uint32_t i = 0; i < n; ++i) {
        const uint32_t a = assign[i];
        if (a == kNone) continue;
        rp.chunks.emplace_back();
        ChunkAssignment& c = rp.chunks.back();
        c.item = i;
        if (a == kWhole) {
          // The item's own box, left implicit: a Box here would be two heap
          // allocations per chunk, most of the cost of a plan at 1000+ ranks.
          c.whole = true;
          continue;
        }
        const Slice& sl = slices_[a];
        const Group& g = groups_[sl.group];
        const size_t nd = keys_[g.key].ndim;
        const int64_t* box = group_boxes_.data() + g.box;
        c.box.offsets.assign(box, box + nd);
        c.box.sizes.assign(box + nd, box + 2 * nd);
        c.box.offsets[0] += sl.begin;
        c.box.sizes[0] = sl.rows;
      }
      if (rp.files > 1) assign_files(&rp, plans_[r].items);
      gp.total_bytes += rp.bytes;
    }
    for (const Group& g : groups_)
      for (uint32_t m = g.begin; m < g.end; ++m)
        gp.ranks[members_[m].rank].replicated.push_back(members_[m].index);
    for (RankPlan& rp : gp.ranks) std::sort(rp.replicated.begin(), rp.replicated.end());
    return gp;
  }

  // Largest chunk first to the file with the fewest bytes so far (ties: the
  // lowest file), so the files of a rank end up about the same size.
  void assign_files(RankPlan* rp, const std::vector<WriteItem>& items) {
    const size_t n = rp->chunks.size();
    chunk_bytes_.resize(n);
    order_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      const ChunkAssignment& c = rp->chunks[i];
      const WriteItem& it = items[c.item];
      // A whole chunk is its item's bytes (intern() checked nbytes).
      chunk_bytes_[i] =
          c.whole ? it.nbytes : static_cast<uint64_t>(numel_of(c.box.sizes)) * dtype_size(it.dtype);
      order_[i] = static_cast<uint32_t>(i);
    }
    std::sort(order_.begin(), order_.end(), [this](uint32_t a, uint32_t b) {
      return chunk_bytes_[a] != chunk_bytes_[b] ? chunk_bytes_[a] > chunk_bytes_[b] : a < b;
    });
    file_load_.assign(rp->files, 0);
    for (uint32_t c : order_) {
      const size_t best =
          std::min_element(file_load_.begin(), file_load_.end()) - file_load_.begin();
      rp->chunks[c].file = static_cast<uint32_t>(best);
      file_load_[best] += chunk_bytes_[c];
    }
  }

  const std::vector<LocalPlan>& plans_;
  const GlobalPlanOptions& opts_;

  std::vector<size_t> base_;            // flat index of each rank's first item
  std::unique_ptr<uint32_t[]> key_of_;  // key id per flat item
  std::unique_ptr<int64_t[]> fbox_;     // boxes in flat (rank, item) order
  size_t fbox_len_ = 0, fbox_cap_ = 0;
  bool uniform_ = false;  // every rank lists the same keys in the same order
  std::vector<KeyInfo> keys_;
  std::unordered_map<std::string_view, uint32_t> ids_;

  std::vector<uint32_t> slow_;        // the keys of layout `other`, for group_key
  std::vector<Group> groups_;         // replicated groups, waiting for the policy
  std::vector<int64_t> group_boxes_;  // each replicated group's box, for its slices
  std::vector<Slot> members_;         // their members
  uint64_t unique_items_ = 0;
  std::vector<uint64_t> load_;       // bytes given to each rank so far
  std::vector<uint32_t> assign_;     // per flat item: kNone, kWhole or a slice
  std::vector<uint32_t> chunks_of_;  // per rank
  std::vector<Slice> slices_;

  // Scratch reused across keys and ranks.
  std::vector<Slot> block_slots_;
  std::vector<int64_t> block_box_;
  std::vector<uint32_t> perm_;
  std::vector<Slot> tmp_slots_;
  std::vector<int64_t> tmp_box_;
  std::vector<uint32_t> distinct_;
  std::vector<std::vector<int64_t>> cuts_;
  std::vector<int64_t> lo_vals_, hi_vals_;
  std::vector<uint32_t> mark_;
  std::vector<size_t> lo_idx_, hi_idx_, cur_;
  std::vector<uint64_t> stride_;
  std::vector<uint32_t> active_;
  std::vector<uint64_t> chunk_bytes_, file_load_;
  std::vector<uint32_t> order_;
};

}  // namespace

Result<GlobalPlan> make_global_plan(const std::vector<LocalPlan>& plans,
                                    const GlobalPlanOptions& opts) {
  return GlobalPlanner(plans, opts).run();
}

}  // namespace ferry
