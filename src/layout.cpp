// Data file layout (writing a safetensors header) and the reverse (parsing
// and checking one). The parser reads untrusted bytes: it is a flat,
// schema-directed recursive descent with no recursion on input structure, so
// hostile input cannot exhaust the stack, and it bounds-checks every read.

#include "layout.hpp"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <unordered_set>

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

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

// Expects valid UTF-8 (checked by the caller): only '"', '\' and control
// characters need escaping for JSON.
void append_json_string(std::string& out, const std::string& s) {
  static const char kHex[] = "0123456789abcdef";
  out += '"';
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20 || c == 0x7f) {
          out += "\\u00";
          out += kHex[c >> 4];
          out += kHex[c & 0xf];
        } else {
          out += ch;
        }
    }
  }
  out += '"';
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
// Header parser. Positions in messages are byte offsets in the JSON text.

class HeaderParser {
 public:
  HeaderParser(const char* begin, size_t n) : begin_(begin), p_(begin), end_(begin + n) {}

  Status parse(SafetensorsHeader* out) {
    skip_ws();
    FERRY_RETURN_IF_ERROR(expect('{'));
    std::unordered_set<std::string> names;
    FERRY_RETURN_IF_ERROR(parse_members('}', [&]() -> Status {
      std::string name;
      FERRY_RETURN_IF_ERROR(parse_key(&name));
      if (!names.insert(name).second) return error("duplicate name '" + name + "'");
      if (name == "__metadata__") return parse_metadata(&out->metadata);
      SafetensorsEntry e;
      e.name = std::move(name);
      FERRY_RETURN_IF_ERROR(parse_entry(&e));
      out->entries.push_back(std::move(e));
      return Status();
    }));
    skip_ws();
    if (p_ != end_) return error("unexpected data after the header object");
    return Status();
  }

 private:
  Status error(const std::string& what) const {
    return Status::corruption("safetensors header: byte " + std::to_string(p_ - begin_) + ": " +
                              what);
  }
  bool at_end() const { return p_ >= end_; }
  bool peek(char c) const { return !at_end() && *p_ == c; }
  void skip_ws() {
    while (!at_end() && (*p_ == ' ' || *p_ == '\t' || *p_ == '\n' || *p_ == '\r')) ++p_;
  }
  // An object member's name and the colon after it.
  Status parse_key(std::string* out) {
    FERRY_RETURN_IF_ERROR(parse_string(out));
    skip_ws();
    FERRY_RETURN_IF_ERROR(expect(':'));
    skip_ws();
    return Status();
  }

  // The members of an array or object up to `close`, its opening bracket
  // already taken: `one` parses each, and commas separate them.
  template <class One>
  Status parse_members(char close, One one) {
    skip_ws();
    if (peek(close)) {
      ++p_;
      return Status();
    }
    while (true) {
      FERRY_RETURN_IF_ERROR(one());
      skip_ws();
      if (!peek(',')) return expect(close);
      ++p_;
      skip_ws();
    }
  }

  Status expect(char c) {
    if (at_end()) return error(std::string("expected '") + c + "', found the end");
    if (*p_ != c) return error(std::string("expected '") + c + "', found " + describe(*p_));
    ++p_;
    return Status();
  }
  static std::string describe(char c) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f) return std::string("'") + c + "'";
    char buf[8];
    std::snprintf(buf, sizeof(buf), "0x%02x", u);
    return buf;
  }

  Status parse_hex4(uint32_t* out) {
    if (end_ - p_ < 4) return error("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i, ++p_) {
      const char c = *p_;
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= c - '0';
      else if (c >= 'a' && c <= 'f')
        v |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F')
        v |= c - 'A' + 10;
      else
        return error("bad hex digit in \\u escape");
    }
    *out = v;
    return Status();
  }

  Status parse_string(std::string* out) {
    if (!peek('"'))
      return at_end() ? error("expected a string, found the end")
                      : error("expected a string, found " + describe(*p_));
    ++p_;
    while (true) {
      if (at_end()) return error("unterminated string");
      const auto c = static_cast<unsigned char>(*p_);
      if (c == '"') {
        ++p_;
        return Status();
      }
      if (c < 0x20) return error("unescaped control character in string");
      if (c == '\\') {
        ++p_;
        if (at_end()) return error("unterminated escape");
        const char e = *p_++;
        switch (e) {
          case '"':
            *out += '"';
            break;
          case '\\':
            *out += '\\';
            break;
          case '/':
            *out += '/';
            break;
          case 'b':
            *out += '\b';
            break;
          case 'f':
            *out += '\f';
            break;
          case 'n':
            *out += '\n';
            break;
          case 'r':
            *out += '\r';
            break;
          case 't':
            *out += '\t';
            break;
          case 'u': {
            uint32_t cp = 0;
            FERRY_RETURN_IF_ERROR(parse_hex4(&cp));
            if (cp >= 0xdc00 && cp <= 0xdfff) return error("lone low surrogate in \\u escape");
            if (cp >= 0xd800 && cp <= 0xdbff) {
              if (end_ - p_ < 2 || p_[0] != '\\' || p_[1] != 'u')
                return error("high surrogate without a low surrogate");
              p_ += 2;
              uint32_t lo = 0;
              FERRY_RETURN_IF_ERROR(parse_hex4(&lo));
              if (lo < 0xdc00 || lo > 0xdfff)
                return error("high surrogate without a low surrogate");
              cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            }
            append_utf8(*out, cp);
            break;
          }
          default:
            --p_;
            return error("bad escape \\" + describe(e));
        }
        continue;
      }
      const size_t n = utf8_sequence_length(reinterpret_cast<const unsigned char*>(p_),
                                            static_cast<size_t>(end_ - p_));
      if (n == 0) return error("invalid UTF-8 in string");
      out->append(p_, n);
      p_ += n;
    }
  }

  // Only what the format uses: non-negative integers. A JSON number with a
  // sign, fraction or exponent is refused with a message saying so.
  Status parse_uint(const char* what, uint64_t* out) {
    if (peek('-')) return error(std::string(what) + " is negative");
    if (at_end() || *p_ < '0' || *p_ > '9') {
      return at_end() ? error(std::string("expected ") + what + ", found the end")
                      : error(std::string("expected ") + what + ", found " + describe(*p_));
    }
    if (*p_ == '0' && end_ - p_ > 1 && p_[1] >= '0' && p_[1] <= '9')
      return error(std::string(what) + " has a leading zero");
    uint64_t v = 0;
    while (!at_end() && *p_ >= '0' && *p_ <= '9') {
      const uint64_t d = static_cast<uint64_t>(*p_ - '0');
      if (v > (std::numeric_limits<uint64_t>::max() - d) / 10)
        return error(std::string(what) + " does not fit in 64 bits");
      v = v * 10 + d;
      ++p_;
    }
    if (peek('.') || peek('e') || peek('E')) return error(std::string(what) + " is not an integer");
    *out = v;
    return Status();
  }

  Status parse_uint_array(const char* what, std::vector<uint64_t>* out) {
    FERRY_RETURN_IF_ERROR(expect('['));
    return parse_members(']', [&]() -> Status {
      uint64_t v = 0;
      FERRY_RETURN_IF_ERROR(parse_uint(what, &v));
      out->push_back(v);
      return Status();
    });
  }

  Status parse_metadata(std::vector<std::pair<std::string, std::string>>* out) {
    FERRY_RETURN_IF_ERROR(expect('{'));
    std::unordered_set<std::string> keys;
    return parse_members('}', [&]() -> Status {
      std::string k, v;
      FERRY_RETURN_IF_ERROR(parse_key(&k));
      if (!peek('"')) return error("__metadata__ value of '" + k + "' is not a string");
      FERRY_RETURN_IF_ERROR(parse_string(&v));
      if (!keys.insert(k).second) return error("duplicate __metadata__ key '" + k + "'");
      out->emplace_back(std::move(k), std::move(v));
      return Status();
    });
  }

  Status parse_entry(SafetensorsEntry* e) {
    if (!peek('{')) return error("entry '" + e->name + "' is not an object");
    ++p_;
    bool has_dtype = false, has_shape = false, has_offsets = false;
    FERRY_RETURN_IF_ERROR(parse_members('}', [&]() -> Status {
      std::string field;
      FERRY_RETURN_IF_ERROR(parse_key(&field));
      bool* seen = nullptr;
      if (field == "dtype") {
        seen = &has_dtype;
        FERRY_RETURN_IF_ERROR(parse_string(&e->dtype));
      } else if (field == "shape") {
        seen = &has_shape;
        std::vector<uint64_t> dims;
        FERRY_RETURN_IF_ERROR(parse_uint_array("a shape dimension", &dims));
        e->shape.clear();
        for (uint64_t d : dims) {
          if (d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
            return error("entry '" + e->name + "': shape dimension " + std::to_string(d) +
                         " is too large");
          e->shape.push_back(static_cast<int64_t>(d));
        }
      } else if (field == "data_offsets") {
        seen = &has_offsets;
        std::vector<uint64_t> offs;
        FERRY_RETURN_IF_ERROR(parse_uint_array("a data offset", &offs));
        if (offs.size() != 2)
          return error("entry '" + e->name + "': data_offsets has " + std::to_string(offs.size()) +
                       " values, expected 2");
        e->begin = offs[0];
        e->end = offs[1];
      } else {
        return error("entry '" + e->name + "': unexpected field '" + field + "'");
      }
      if (*seen) return error("entry '" + e->name + "': field '" + field + "' repeated");
      *seen = true;
      return Status();
    }));
    if (!has_dtype) return error("entry '" + e->name + "' has no dtype");
    if (!has_shape) return error("entry '" + e->name + "' has no shape");
    if (!has_offsets) return error("entry '" + e->name + "' has no data_offsets");
    return Status();
  }

  const char* begin_;
  const char* p_;
  const char* end_;
};

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
  HeaderParser parser(prefix.data() + 8, n);
  FERRY_RETURN_IF_ERROR(parser.parse(&h));

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
