// Data file layout (writing a safetensors header) and the reverse (parsing
// and checking one, from untrusted bytes).

#include "layout.hpp"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <unordered_set>

#include <rapidjson/error/en.h>
#include <rapidjson/memorystream.h>
#include <rapidjson/reader.h>
#include <rapidjson/stringbuffer.h>
#include <rapidjson/writer.h>

#include "codec.hpp"

namespace ferry {
namespace {

// Same bound as the reference safetensors implementation: a larger header is
// taken as garbage rather than allocated.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

bool mul_u64(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

// Length of the well-formed UTF-8 sequence at s[i], or 0 if it is not one
// (overlong forms, surrogates and code points past U+10FFFF are refused, as
// strict JSON readers do).
size_t utf8_sequence_length(const unsigned char* s, size_t n) {
  const unsigned char c = s[0];
  if (c < 0x80) return 1;
  size_t len;
  uint32_t cp;
  if (c >= 0xc2 && c <= 0xdf) {
    len = 2;
    cp = c & 0x1f;
  } else if (c >= 0xe0 && c <= 0xef) {
    len = 3;
    cp = c & 0x0f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    len = 4;
    cp = c & 0x07;
  } else {
    return 0;
  }
  if (n < len) return 0;
  for (size_t i = 1; i < len; ++i) {
    if ((s[i] & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (s[i] & 0x3f);
  }
  if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10ffff))) return 0;
  if (cp >= 0xd800 && cp <= 0xdfff) return 0;
  return len;
}

bool is_valid_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_sequence_length(p + i, s.size() - i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

// The one JSON string writer (headers, the export index, the C ABI's plans).
// Expects valid UTF-8 (checked by the caller).
void append_json_string(std::string& out, const std::string& s) {
  rapidjson::StringBuffer buf;
  rapidjson::Writer<rapidjson::StringBuffer> w(buf);
  w.String(s.data(), static_cast<rapidjson::SizeType>(s.size()));
  out.append(buf.GetString(), buf.GetSize());
}

// Checks one chunk and returns its byte size.
Result<uint64_t> chunk_bytes(const std::string& file, const ChunkRef& c) {
  const std::string who = "file '" + file + "': tensor '" + c.key + "'";
  if (c.key.empty()) return Status::invalid_argument("file '" + file + "': empty tensor key");
  if (!is_valid_utf8(c.key))
    return Status::invalid_argument(who + ": key is not valid UTF-8 (safetensors needs it)");
  const uint64_t elem = dtype_size(c.dtype);
  if (elem == 0) return Status::invalid_argument(who + ": unknown dtype");
  const size_t rank = c.global_shape.size();
  if (c.box.offsets.size() != rank || c.box.sizes.size() != rank)
    return Status::invalid_argument(
        who + ": box rank (offsets " + std::to_string(c.box.offsets.size()) + ", sizes " +
        std::to_string(c.box.sizes.size()) + ") differs from tensor rank " + std::to_string(rank));
  uint64_t numel = 1;
  bool overflow = false;
  for (size_t d = 0; d < rank; ++d) {
    const int64_t o = c.box.offsets[d], s = c.box.sizes[d], g = c.global_shape[d];
    if (o < 0 || s < 0 || o > g || s > g - o)
      return Status::invalid_argument(who + ": box offsets " + shape_to_string(c.box.offsets) +
                                      " sizes " + shape_to_string(c.box.sizes) +
                                      " lies outside global shape " +
                                      shape_to_string(c.global_shape));
    overflow = overflow || !mul_u64(numel, static_cast<uint64_t>(s), &numel);
  }
  uint64_t bytes = 0;
  if (overflow || !mul_u64(numel, elem, &bytes) ||
      bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    return Status::invalid_argument(who + ": chunk " + shape_to_string(c.box.sizes) +
                                    " is too large");
  return bytes;
}

// ---------------------------------------------------------------------------
// Header parser: RapidJSON's SAX reader, iterative (no recursion on the
// input's nesting, so hostile input cannot exhaust the stack) and checking
// UTF-8, drives this visitor, which holds the header to the safetensors
// schema as the events arrive. Numbers come as their text, so a sign,
// fraction, exponent or a value past 64 bits is named as such.

class HeaderVisitor : public rapidjson::BaseReaderHandler<rapidjson::UTF8<>, HeaderVisitor> {
 public:
  explicit HeaderVisitor(SafetensorsHeader* out) : out_(out) {}

  // Why the visitor stopped the reader ("" when the JSON itself was bad).
  const std::string& why() const { return why_; }

  bool StartObject() {
    switch (at_) {
      case At::start:
        at_ = At::top;
        return true;
      case At::value:
        if (in_metadata_) {
          at_ = At::metadata;
          return true;
        }
        at_ = At::entry;
        return true;
      default:
        return unexpected("an object");
    }
  }
  bool Key(const char* s, rapidjson::SizeType n, bool) {
    std::string k(s, n);
    if (!is_valid_utf8(k)) return fail("invalid UTF-8 in a name");
    switch (at_) {
      case At::top:
        if (!names_.insert(k).second) return fail("duplicate name '" + k + "'");
        in_metadata_ = k == "__metadata__";
        if (!in_metadata_) {
          out_->entries.emplace_back();
          out_->entries.back().name = std::move(k);
          seen_ = 0;
        }
        at_ = At::value;
        return true;
      case At::metadata:
        if (!meta_keys_.insert(k).second) return fail("duplicate __metadata__ key '" + k + "'");
        out_->metadata.emplace_back(std::move(k), std::string());
        at_ = At::metadata_value;
        return true;
      case At::entry: {
        for (field_ = 0; field_ < 3 && k != kFields[field_]; ++field_) {
        }
        if (field_ == 3) return fail(entry() + ": unexpected field '" + k + "'");
        if (seen_ & (1u << field_)) return fail(entry() + ": field '" + k + "' repeated");
        seen_ |= 1u << field_;
        at_ = At::field;
        return true;
      }
      default:
        return unexpected("a name");
    }
  }
  bool String(const char* s, rapidjson::SizeType n, bool) {
    std::string v(s, n);
    if (!is_valid_utf8(v)) return fail("invalid UTF-8 in a string");
    if (at_ == At::metadata_value) {
      out_->metadata.back().second = std::move(v);
      at_ = At::metadata;
      return true;
    }
    if (at_ == At::field && field_ == 0) {
      out_->entries.back().dtype = std::move(v);
      at_ = At::entry;
      return true;
    }
    return unexpected("a string");
  }
  bool StartArray() {
    if (at_ == At::field && field_ > 0) {
      at_ = At::numbers;
      numbers_.clear();
      return true;
    }
    return unexpected("an array");
  }
  bool RawNumber(const char* s, rapidjson::SizeType n, bool) {
    const char* what = field_ == 1 ? "a shape dimension" : "a data offset";
    if (at_ != At::numbers) return unexpected("a number");
    if (n > 0 && s[0] == '-') return fail(std::string(what) + " is negative");
    uint64_t v = 0;
    for (rapidjson::SizeType i = 0; i < n; ++i) {
      if (s[i] < '0' || s[i] > '9') return fail(std::string(what) + " is not an integer");
      const uint64_t d = static_cast<uint64_t>(s[i] - '0');
      if (v > (std::numeric_limits<uint64_t>::max() - d) / 10)
        return fail(std::string(what) + " does not fit in 64 bits");
      v = v * 10 + d;
    }
    numbers_.push_back(v);
    return true;
  }
  bool EndArray(rapidjson::SizeType) {
    if (at_ != At::numbers) return unexpected("the end of an array");
    SafetensorsEntry& e = out_->entries.back();
    if (field_ == 1) {
      e.shape.clear();
      for (uint64_t d : numbers_) {
        if (d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
          return fail(entry() + ": shape dimension " + std::to_string(d) + " is too large");
        e.shape.push_back(static_cast<int64_t>(d));
      }
    } else {
      if (numbers_.size() != 2)
        return fail(entry() + ": data_offsets has " + std::to_string(numbers_.size()) +
                    " values, expected 2");
      e.begin = numbers_[0];
      e.end = numbers_[1];
    }
    at_ = At::entry;
    return true;
  }
  bool EndObject(rapidjson::SizeType) {
    switch (at_) {
      case At::top:
        at_ = At::done;
        return true;
      case At::metadata:
        at_ = At::top;
        return true;
      case At::entry: {
        for (int f = 0; f < 3; ++f)
          if (!(seen_ & (1u << f))) return fail(entry() + " has no " + kFields[f]);
        at_ = At::top;
        return true;
      }
      default:
        return unexpected("the end of an object");
    }
  }
  // Anything else (null, booleans) is out of the schema; so are numbers,
  // which arrive as RawNumber.
  bool Default() { return unexpected("a value of another type"); }

 private:
  enum class At { start, top, value, metadata, metadata_value, entry, field, numbers, done };
  static constexpr const char* kFields[] = {"dtype", "shape", "data_offsets"};

  std::string entry() const { return "entry '" + out_->entries.back().name + "'"; }
  bool fail(std::string why) {
    why_ = std::move(why);
    return false;
  }
  // What the schema expected where `found` came.
  bool unexpected(const char* found) {
    switch (at_) {
      case At::value:
        return fail(in_metadata_ ? std::string("__metadata__ is not an object")
                                 : entry() + " is not an object");
      case At::metadata_value:
        return fail("__metadata__ value of '" + out_->metadata.back().first + "' is not a string");
      case At::field:
        return fail(entry() + ": field '" + kFields[field_] + "' holds " + found);
      case At::numbers:
        return fail(entry() + ": expected an integer, found " + found);
      default:
        return fail(std::string("unexpected ") + found);
    }
  }

  SafetensorsHeader* out_;
  At at_ = At::start;
  bool in_metadata_ = false;
  int field_ = 0;      // 0 dtype, 1 shape, 2 data_offsets
  unsigned seen_ = 0;  // fields of the current entry, a bit each
  std::vector<uint64_t> numbers_;
  std::unordered_set<std::string> names_, meta_keys_;
  std::string why_;
};

// Parses the JSON text of a header into `out`; a corruption error names
// the byte it stopped at.
Status parse_header_json(const char* text, size_t n, SafetensorsHeader* out) {
  HeaderVisitor v(out);
  rapidjson::Reader reader;
  rapidjson::MemoryStream ms(text, n);
  constexpr unsigned kFlags = rapidjson::kParseIterativeFlag |
                              rapidjson::kParseValidateEncodingFlag |
                              rapidjson::kParseNumbersAsStringsFlag;
  const rapidjson::ParseResult r = reader.Parse<kFlags>(ms, v);
  if (!r) {
    std::string what = v.why();
    if (what.empty() && r.Code() == rapidjson::kParseErrorDocumentRootNotSingular)
      what = "unexpected data after the header object";
    else if (what.empty() && r.Offset() < n && static_cast<unsigned char>(text[r.Offset()]) < 0x20)
      what = "unescaped control character in string";  // RapidJSON calls it a bad escape
    else if (what.empty())
      what = rapidjson::GetParseError_En(r.Code());
    return Status::corruption("safetensors header: byte " + std::to_string(r.Offset()) + ": " +
                              what);
  }
  return Status();
}

}  // namespace

std::string entry_name(const std::string& key, const Box& box) {
  std::string s = key;
  s += '@';
  for (size_t i = 0; i < box.offsets.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(box.offsets[i]);
  }
  return s;
}

std::string data_file_name(const std::string& prefix, int32_t rank, uint32_t file,
                           const std::string& extension) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "-%05d-%04u.", rank, file);
  return prefix + buf + extension;
}

std::vector<std::vector<FilePiece>> pack_into_files(
    const std::vector<ChunkRef>& chunks, uint64_t shard_size,
    const std::function<uint64_t(uint64_t)>& stored) {
  auto size_of = [&](uint64_t raw) { return stored ? stored(raw) : raw; };
  std::vector<std::vector<FilePiece>> files(1);
  uint64_t used = 0;
  auto next_file = [&] {
    files.emplace_back();
    used = 0;
  };
  for (size_t i = 0; i < chunks.size(); ++i) {
    const ChunkRef& c = chunks[i];
    const uint64_t raw = c.nbytes();
    const uint64_t bytes = size_of(raw);
    if (shard_size == 0 || used + bytes <= shard_size) {
      files.back().push_back({i, c, 0});
      used += bytes;
      continue;
    }
    const int64_t rows = c.box.sizes.empty() ? 0 : c.box.sizes[0];
    if (rows <= 1 || bytes <= shard_size) {  // cannot split, or fits in a file of its own
      if (!files.back().empty()) next_file();
      files.back().push_back({i, c, 0});
      used = bytes;
      continue;
    }
    const uint64_t row_bytes = raw / static_cast<uint64_t>(rows);
    // The most rows whose stored size fits in `room` (sizes grow with rows).
    auto rows_within = [&](uint64_t room, int64_t most) {
      int64_t lo = 0, hi = std::min<int64_t>(most, static_cast<int64_t>(room / row_bytes));
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo + 1) / 2;
        if (size_of(static_cast<uint64_t>(mid) * row_bytes) <= room)
          lo = mid;
        else
          hi = mid - 1;
      }
      return lo;
    };
    int64_t row = 0;
    while (row < rows) {
      int64_t take = used >= shard_size ? 0 : rows_within(shard_size - used, rows - row);
      if (take == 0 && !files.back().empty()) {
        next_file();
        continue;
      }
      take = std::max<int64_t>(take, 1);
      FilePiece p{i, c, static_cast<uint64_t>(row) * row_bytes};
      p.chunk.box.offsets[0] += row;
      p.chunk.box.sizes[0] = take;
      files.back().push_back(std::move(p));
      used += size_of(static_cast<uint64_t>(take) * row_bytes);
      row += take;
    }
  }
  if (files.back().empty() && files.size() > 1) files.pop_back();
  return files;
}

Result<FileLayout> layout_file(std::string name, std::vector<ChunkRef> chunks) {
  FileLayout out;
  bool compressed = false;
  for (const auto& c : chunks) compressed = compressed || c.compressed;
  // Readers that only know safetensors see opaque U8 blobs in a compressed
  // file; the codec here tells a person what they are.
  std::vector<std::pair<std::string, std::string>> meta = {{"format", "ferry"}};
  if (compressed) meta.emplace_back("codec", "zstd");
  std::vector<SafetensorsEntry> entries;
  entries.reserve(chunks.size());
  std::unordered_set<std::string> names;
  uint64_t pos = 0;  // relative to the data start until the header size is known
  out.chunks.reserve(chunks.size());
  for (auto& c : chunks) {
    FERRY_ASSIGN_OR_RETURN(uint64_t bytes, chunk_bytes(name, c));
    if (c.compressed) bytes = c.compressed->data.size();
    std::string entry = entry_name(c.key, c.box);
    if (!names.insert(entry).second)
      return Status::invalid_argument("file '" + name + "': duplicate safetensors entry '" + entry +
                                      "'");
    if (pos > std::numeric_limits<uint64_t>::max() / 2 - bytes)
      return Status::invalid_argument("file '" + name + "': total size overflows");
    if (c.compressed)
      entries.push_back({entry, "U8", {static_cast<int64_t>(bytes)}, pos, pos + bytes});
    else
      entries.push_back({entry, dtype_name(c.dtype), c.box.sizes, pos, pos + bytes});
    LaidOutChunk lc;
    lc.chunk = std::move(c);
    lc.entry = std::move(entry);
    lc.offset = pos;
    lc.length = bytes;
    out.chunks.push_back(std::move(lc));
    pos += bytes;
  }
  // Data starts on an O_DIRECT-able boundary.
  auto header = safetensors_header(entries, meta, kDataAlignment);
  if (!header.ok()) return header.status().with_context("file '" + name + "': ");
  out.header = std::move(header).value();
  for (auto& lc : out.chunks) lc.offset += out.header.size();
  out.size = out.header.size() + pos;
  out.name = std::move(name);
  return out;
}

Result<SafetensorsHeader> parse_safetensors_header(const std::string& prefix, uint64_t file_size) {
  if (file_size < 8)
    return Status::corruption("safetensors file is " + std::to_string(file_size) +
                              " bytes, too short for the 8-byte header length");
  if (prefix.size() < 8)
    return Status::corruption("safetensors header: only " + std::to_string(prefix.size()) +
                              " bytes given, need the 8-byte header length");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i)
    n |= static_cast<uint64_t>(static_cast<unsigned char>(prefix[i])) << (8 * i);
  if (n > kMaxHeaderBytes)
    return Status::corruption("safetensors header length " + std::to_string(n) +
                              " exceeds the limit of " + std::to_string(kMaxHeaderBytes));
  if (n > file_size - 8)
    return Status::corruption("safetensors header length " + std::to_string(n) +
                              " runs past the end of the " + std::to_string(file_size) +
                              "-byte file");
  if (prefix.size() - 8 < n)
    return Status::corruption("safetensors header length is " + std::to_string(n) + " but only " +
                              std::to_string(prefix.size() - 8) + " header bytes were given");
  if (n == 0 || prefix[8] != '{')
    return Status::corruption("safetensors header does not start with '{'");

  SafetensorsHeader h;
  h.data_start = 8 + n;
  FERRY_RETURN_IF_ERROR(parse_header_json(prefix.data() + 8, n, &h));

  for (const auto& e : h.entries) {
    const std::string who = "safetensors entry '" + e.name + "'";
    auto dtype = parse_dtype(e.dtype);
    if (!dtype.ok()) return Status::corruption(who + ": unknown dtype '" + e.dtype + "'");
    uint64_t bytes = dtype_size(dtype.value());
    bool overflow = false;
    for (int64_t d : e.shape)
      overflow = overflow || !mul_u64(bytes, static_cast<uint64_t>(d), &bytes);
    if (overflow)
      return Status::corruption(who + ": shape " + shape_to_string(e.shape) + " overflows");
    if (e.begin > e.end)
      return Status::corruption(who + ": data_offsets [" + std::to_string(e.begin) + ", " +
                                std::to_string(e.end) + "] are reversed");
    if (e.end - e.begin != bytes)
      return Status::corruption(who + ": shape " + shape_to_string(e.shape) + " of " + e.dtype +
                                " is " + std::to_string(bytes) + " bytes but data_offsets span " +
                                std::to_string(e.end - e.begin));
  }

  // Returned in file order; within one offset an empty entry sorts first, so
  // zero-size tensors anywhere still count as contiguous.
  std::stable_sort(h.entries.begin(), h.entries.end(),
                   [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
                     return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
                   });
  uint64_t expected = 0;
  for (const auto& e : h.entries) {
    if (e.begin != expected)
      return Status::corruption("safetensors entry '" + e.name + "' starts at " +
                                std::to_string(e.begin) + ", expected " + std::to_string(expected) +
                                (e.begin < expected ? " (overlap)" : " (gap)"));
    expected = e.end;
  }
  const uint64_t data_bytes = file_size - h.data_start;
  if (expected != data_bytes)
    return Status::corruption("safetensors entries cover " + std::to_string(expected) +
                              " data bytes but the file holds " + std::to_string(data_bytes));
  return h;
}

std::string json_string(const std::string& s) {
  std::string out;
  append_json_string(out, s);
  return out;
}

Result<std::string> safetensors_header(
    const std::vector<SafetensorsEntry>& entries,
    const std::vector<std::pair<std::string, std::string>>& metadata, uint64_t alignment) {
  std::string json = "{";
  if (!metadata.empty()) {
    json += "\"__metadata__\":{";
    for (size_t i = 0; i < metadata.size(); ++i) {
      const auto& [k, v] = metadata[i];
      if (!is_valid_utf8(k) || !is_valid_utf8(v))
        return Status::invalid_argument("metadata '" + (is_valid_utf8(k) ? k : std::string("?")) +
                                        "' is not valid UTF-8, which a safetensors header needs");
      json += i ? "," : "";
      append_json_string(json, k);
      json += ':';
      append_json_string(json, v);
    }
    json += '}';
  }
  for (size_t i = 0; i < entries.size(); ++i) {
    const SafetensorsEntry& e = entries[i];
    if (!is_valid_utf8(e.name))
      return Status::invalid_argument("entry " + std::to_string(i) +
                                      " has a name that is not valid UTF-8");
    json += (i || !metadata.empty()) ? "," : "";
    append_json_string(json, e.name);
    json += ":{\"dtype\":\"" + e.dtype + "\",\"shape\":" + shape_to_string(e.shape) +
            ",\"data_offsets\":[" + std::to_string(e.begin) + "," + std::to_string(e.end) + "]}";
  }
  json += '}';
  // Trailing spaces are JSON whitespace: padding keeps the header valid for
  // every reader while the data starts on the boundary asked for.
  const uint64_t a = std::max<uint64_t>(alignment, 1);
  const uint64_t padded = (8 + json.size() + a - 1) / a * a;
  const uint64_t n = padded - 8;
  json.append(n - json.size(), ' ');
  std::string out;
  out.reserve(padded);
  for (int i = 0; i < 8; ++i) out += static_cast<char>((n >> (8 * i)) & 0xff);
  return out + json;
}

}  // namespace ferry
