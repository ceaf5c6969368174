// The caller's tensors as Ferry sees them: non-owning views, plus the shard a
// view holds of a global tensor, collected in a StateDict.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ferry/export_macro.hpp"
#include "ferry/status.hpp"

namespace ferry {

enum class DType : uint8_t {
  boolean,
  u8,
  i8,
  i16,
  u16,
  i32,
  u32,
  i64,
  u64,
  f16,
  bf16,
  f32,
  f64,
  f8_e4m3,
  f8_e5m2,
};

FERRY_EXPORT size_t dtype_size(DType d);
// Safetensors spelling: "F32", "BF16", "BOOL", "F8_E4M3", ...
FERRY_EXPORT const char* dtype_name(DType d);
FERRY_EXPORT Result<DType> parse_dtype(const std::string& name);
// How every message spells a shape, "[4096, 128]".
FERRY_EXPORT std::string shape_to_string(const std::vector<int64_t>& dims);

struct FERRY_EXPORT Device {
  enum class Kind : uint8_t { host, cuda };
  Kind kind = Kind::host;
  int index = 0;

  static Device host() { return {}; }
  static Device cuda(int i) { return {Kind::cuda, i}; }
  bool is_host() const { return kind == Kind::host; }
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  std::string to_string() const;  // "host", "cuda:0"
};

// A non-owning view of the caller's tensor memory. `strides` are in elements;
// empty means row-major contiguous. The memory must stay valid (and, until
// wait_snapshot(), unchanged) for as long as Ferry uses it.
struct FERRY_EXPORT TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  Device device;

  TensorView() = default;
  TensorView(void* d, DType t, std::vector<int64_t> s, Device dev = Device::host(),
             std::vector<int64_t> st = {})
      : data(d), dtype(t), shape(std::move(s)), strides(std::move(st)), device(dev) {}

  int64_t numel() const;
  uint64_t nbytes() const { return static_cast<uint64_t>(numel()) * dtype_size(dtype); }
  bool is_contiguous() const;
  // Row-major element strides (the given ones, or computed from shape).
  std::vector<int64_t> effective_strides() const;
};

// Where a view sits in its global tensor: the global shape and this view's
// offsets in every dimension. A view without a Shard is the whole tensor.
struct Shard {
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offsets;
};

// What a load into another world size does with a per-rank entry (one value
// per saving rank, StateDict::add_per_rank). Into the same world size every
// rank gets its own value whatever the policy.
enum class OnResize : uint8_t {
  error,  // the load fails, naming the key and both world sizes
  first,  // every rank gets rank 0's value
};

struct StateEntry {
  std::string key;
  TensorView view;
  std::optional<Shard> shard;
  // One value per rank (an RNG state, a data position): each rank's is
  // stored under per_rank_key(key, rank), never treated as a replica, and a
  // load gives each rank its own (on_resize: when the world size changed).
  bool per_rank = false;
  OnResize on_resize = OnResize::error;
};

// The checkpoint key of rank `rank`'s value of per-rank entry `key`:
// "<key>@rank<rank>". Keys of that form are reserved for it.
FERRY_EXPORT std::string per_rank_key(const std::string& key, int32_t rank);
// The (entry key, rank) a checkpoint key of that form names; nullopt otherwise.
FERRY_EXPORT std::optional<std::pair<std::string, int32_t>> parse_per_rank_key(
    const std::string& key);

// Keys are unique; insertion order is kept (it is the order of the files).
// Copies share their entries until one of them is changed (copy on write),
// so handing a state dict to a save costs O(1), not O(n).
class FERRY_EXPORT StateDict {
 public:
  // Returns invalid_argument for a duplicate or empty key. O(1): a state dict
  // of n entries is built in O(n).
  Status add(std::string key, TensorView view, std::optional<Shard> shard = std::nullopt);
  // A per-rank entry (StateEntry::per_rank): a whole tensor, no Shard.
  Status add_per_rank(std::string key, TensorView view, OnResize on_resize = OnResize::error);
  const std::vector<StateEntry>& entries() const;
  // REQUIRES: keys are not changed through this reference (the index of
  // find() and add() holds them); views and shards may be. The reference is
  // this state dict's own until it is next copied: change entries through
  // it before copying the state dict, not after.
  std::vector<StateEntry>& entries();
  size_t size() const;
  bool empty() const { return size() == 0; }
  const StateEntry* find(const std::string& key) const;
  // Room for n entries, so adding them allocates nothing but the entries'
  // own keys and shapes.
  void reserve(size_t n);

 private:
  struct Data;  // the entries and an index of their keys (tensor.cpp)
  Data& mut();  // this state dict's own data (copied first if shared)
  std::shared_ptr<Data> d_;
};

// Checks one entry: known dtype, shape >= 0, strides rank, shard inside its
// global shape, non-null data when bytes > 0. The message names the key.
FERRY_EXPORT Status validate_entry(const StateEntry& e);

}  // namespace ferry
