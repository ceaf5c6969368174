#include "ferry/tensor.hpp"

#include <atomic>
#include <functional>
#include <limits>
#include <string_view>

namespace ferry {

namespace {
struct DTypeInfo {
  DType d;
  const char* name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::boolean, "BOOL", 1}, {DType::u8, "U8", 1},           {DType::i8, "I8", 1},
    {DType::i16, "I16", 2},      {DType::u16, "U16", 2},         {DType::i32, "I32", 4},
    {DType::u32, "U32", 4},      {DType::i64, "I64", 8},         {DType::u64, "U64", 8},
    {DType::f16, "F16", 2},      {DType::bf16, "BF16", 2},       {DType::f32, "F32", 4},
    {DType::f64, "F64", 8},      {DType::f8_e4m3, "F8_E4M3", 1}, {DType::f8_e5m2, "F8_E5M2", 1},
};
const DTypeInfo* info(DType d) {
  for (const auto& i : kDTypes)
    if (i.d == d) return &i;
  return nullptr;
}
}  // namespace

size_t dtype_size(DType d) {
  const auto* i = info(d);
  return i ? i->size : 0;
}

const char* dtype_name(DType d) {
  const auto* i = info(d);
  return i ? i->name : "INVALID";
}

Result<DType> parse_dtype(const std::string& name) {
  for (const auto& i : kDTypes)
    if (name == i.name) return i.d;
  return Status::invalid_argument("unknown dtype '" + name + "'");
}

std::string Device::to_string() const {
  return kind == Kind::host ? "host" : "cuda:" + std::to_string(index);
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::vector<int64_t> TensorView::effective_strides() const {
  if (!strides.empty()) return strides;
  std::vector<int64_t> st(shape.size());
  int64_t acc = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    st[i] = acc;
    acc *= shape[i];
  }
  return st;
}

bool TensorView::is_contiguous() const {
  if (strides.empty()) return true;
  int64_t acc = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && strides[i] != acc) return false;
    acc *= shape[i];
  }
  return true;
}

// The keys are indexed by open addressing over entry positions: one slot per
// position (position + 1; 0 = empty), at most half full, so adding an entry
// allocates no node and copies no key. Each slot also holds its key's hash's
// high bits: a probe passes the other keys in its way without reading them
// (at 100,000 keys each read is a cache miss or two: the entry, its key).
struct StateDict::Data {
  struct Slot {
    uint32_t pos = 0;
    uint32_t tag = 0;
  };
  std::vector<StateEntry> entries;
  std::vector<Slot> slots;  // empty or a power of two

  static size_t hash(std::string_view k) { return std::hash<std::string_view>{}(k); }
  // The bits of a hash the slot index does not use (for a table under 2^32 slots).
  static uint32_t tag(size_t h) { return static_cast<uint32_t>(static_cast<uint64_t>(h) >> 32); }
  // The slot holding `key`'s entry, or the empty slot where it would go;
  // `h`: hash(key).
  size_t probe(std::string_view key, size_t h) const {
    const size_t mask = slots.size() - 1;
    const uint32_t t = tag(h);
    for (size_t i = h & mask;; i = (i + 1) & mask) {
      const Slot s = slots[i];
      if (s.pos == 0 || (s.tag == t && entries[s.pos - 1].key == key)) return i;
    }
  }
  // Room in the index for n entries.
  void grow(size_t n) {
    if (slots.size() >= 2 * n) return;
    size_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    slots.assign(cap, Slot{});
    for (size_t e = 0; e < entries.size(); ++e) {
      const size_t h = hash(entries[e].key);
      slots[probe(entries[e].key, h)] = {static_cast<uint32_t>(e + 1), tag(h)};
    }
  }
};

StateDict::Data& StateDict::mut() {
  if (!d_) {
    d_ = std::make_shared<Data>();
  } else if (d_.use_count() > 1) {
    d_ = std::make_shared<Data>(*d_);
  } else {
    // The last other owner may have just let go on another thread: its reads
    // happen before these writes.
    std::atomic_thread_fence(std::memory_order_acquire);
  }
  return *d_;
}

const std::vector<StateEntry>& StateDict::entries() const {
  static const std::vector<StateEntry> kNone;
  return d_ ? d_->entries : kNone;
}

std::vector<StateEntry>& StateDict::entries() {
  return mut().entries;
}

size_t StateDict::size() const {
  return d_ ? d_->entries.size() : 0;
}

void StateDict::reserve(size_t n) {
  Data& d = mut();
  d.entries.reserve(n);
  d.grow(n);
}

Status StateDict::add(std::string key, TensorView view, std::optional<Shard> shard) {
  if (key.empty()) return Status::invalid_argument("state dict key is empty");
  Data& d = mut();
  // Positions are stored as uint32_t + 1.
  if (d.entries.size() >= std::numeric_limits<uint32_t>::max() - 1)
    return Status::invalid_argument("state dict key '" + key + "': a state dict holds at most " +
                                    std::to_string(std::numeric_limits<uint32_t>::max() - 1) +
                                    " entries");
  d.grow(d.entries.size() + 1);
  const size_t h = Data::hash(key);
  const size_t slot = d.probe(key, h);
  if (d.slots[slot].pos != 0)
    return Status::invalid_argument("duplicate state dict key '" + key + "'");
  d.slots[slot] = {static_cast<uint32_t>(d.entries.size() + 1), Data::tag(h)};
  d.entries.push_back({std::move(key), std::move(view), std::move(shard)});
  return Status();
}

Status StateDict::add_per_rank(std::string key, TensorView view, OnResize on_resize) {
  FERRY_RETURN_IF_ERROR(add(std::move(key), std::move(view)));
  StateEntry& e = mut().entries.back();
  e.per_rank = true;
  e.on_resize = on_resize;
  return Status();
}

namespace {
constexpr std::string_view kPerRankTag = "@rank";
}  // namespace

std::string per_rank_key(const std::string& key, int32_t rank) {
  return key + std::string(kPerRankTag) + std::to_string(rank);
}

std::optional<std::pair<std::string, int32_t>> parse_per_rank_key(const std::string& key) {
  size_t digits = 0;
  while (digits < key.size() && digits < 10 && key[key.size() - 1 - digits] >= '0' &&
         key[key.size() - 1 - digits] <= '9')
    ++digits;
  if (digits == 0 || key.size() < digits + kPerRankTag.size() + 1) return std::nullopt;
  const size_t tag = key.size() - digits - kPerRankTag.size();
  if (key.compare(tag, kPerRankTag.size(), kPerRankTag) != 0) return std::nullopt;
  const std::string num = key.substr(key.size() - digits);
  if (num.size() > 1 && num[0] == '0') return std::nullopt;  // one spelling per rank
  const long long r = std::stoll(num);
  if (r > std::numeric_limits<int32_t>::max()) return std::nullopt;
  return std::make_pair(key.substr(0, tag), static_cast<int32_t>(r));
}

const StateEntry* StateDict::find(const std::string& key) const {
  if (!d_ || d_->slots.empty()) return nullptr;
  const uint32_t s = d_->slots[d_->probe(key, Data::hash(key))].pos;
  return s ? &d_->entries[s - 1] : nullptr;
}

Status validate_entry(const StateEntry& e) {
  const auto& v = e.view;
  auto bad = [&](const std::string& why) {
    return Status::invalid_argument("tensor '" + e.key + "': " + why);
  };
  if (dtype_size(v.dtype) == 0) return bad("unknown dtype");
  for (int64_t s : v.shape)
    if (s < 0) return bad("negative dimension in shape");
  if (!v.strides.empty() && v.strides.size() != v.shape.size())
    return bad("strides have rank " + std::to_string(v.strides.size()) + ", shape has rank " +
               std::to_string(v.shape.size()));
  for (int64_t s : v.strides)
    if (s < 0) return bad("negative stride");
  // Overflow guard: numel * size must fit in 63 bits.
  int64_t n = 1;
  for (int64_t s : v.shape) {
    if (s != 0 && n > std::numeric_limits<int64_t>::max() / 8 / s) return bad("shape too large");
    n *= s;
  }
  if (n > 0 && v.data == nullptr) return bad("data pointer is null");
  if (e.per_rank && e.shard)
    return bad("a per-rank entry is one whole value per rank; it cannot be a shard");
  if (e.shard) {
    const auto& sh = *e.shard;
    if (sh.global_shape.size() != v.shape.size() || sh.offsets.size() != v.shape.size())
      return bad("shard rank (global shape " + std::to_string(sh.global_shape.size()) +
                 ", offsets " + std::to_string(sh.offsets.size()) + ") differs from view rank " +
                 std::to_string(v.shape.size()));
    for (size_t i = 0; i < v.shape.size(); ++i) {
      if (sh.offsets[i] < 0 || sh.global_shape[i] < 0 ||
          sh.offsets[i] + v.shape[i] > sh.global_shape[i])
        return bad("shard dim " + std::to_string(i) + " [" + std::to_string(sh.offsets[i]) + ", " +
                   std::to_string(sh.offsets[i] + v.shape[i]) + ") exceeds global size " +
                   std::to_string(sh.global_shape[i]));
    }
  }
  return Status();
}

}  // namespace ferry
