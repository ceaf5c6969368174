#include "layout.hpp"

#include <catch2/catch.hpp>

#include <random>
#include <string>

namespace {

using ferry::Box;
using ferry::ChunkRef;
using ferry::DType;
using ferry::StatusCode;

ChunkRef chunk(std::string key, DType dtype, std::vector<int64_t> global,
               std::vector<int64_t> offsets, std::vector<int64_t> sizes) {
  ChunkRef c;
  c.key = std::move(key);
  c.dtype = dtype;
  c.global_shape = std::move(global);
  c.box.offsets = std::move(offsets);
  c.box.sizes = std::move(sizes);
  return c;
}

uint64_t read_le64(const std::string& s) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i)
    v |= static_cast<uint64_t>(static_cast<unsigned char>(s[i])) << (8 * i);
  return v;
}

// A header holding `json` verbatim, for a file with `data` bytes after it.
std::string header_of(const std::string& json) {
  std::string h;
  for (int i = 0; i < 8; ++i) h += static_cast<char>((json.size() >> (8 * i)) & 0xff);
  return h + json;
}

ferry::Result<ferry::SafetensorsHeader> parse_json(const std::string& json, uint64_t data) {
  const std::string h = header_of(json);
  return ferry::parse_safetensors_header(h, h.size() + data);
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

std::vector<ChunkRef> sample_chunks() {
  return {
      chunk("model.w", DType::f32, {8, 4}, {0, 0}, {4, 4}),
      chunk("model.w", DType::f32, {8, 4}, {4, 0}, {4, 4}),
      chunk("model.b", DType::bf16, {3}, {0}, {3}),
      chunk("step", DType::i64, {}, {}, {}),
      chunk("empty", DType::f16, {0, 5}, {0, 0}, {0, 5}),
      chunk("mask", DType::boolean, {7}, {0}, {7}),
  };
}

}  // namespace

TEST_CASE("layout: entry and file names", "[layout]") {
  REQUIRE(ferry::entry_name("layer0.weight", Box{{4096, 0}, {4096, 4096}}) ==
          "layer0.weight@4096,0");
  REQUIRE(ferry::entry_name("step", Box{}) == "step@");
  REQUIRE(ferry::entry_name("v", Box{{7}, {1}}) == "v@7");
  REQUIRE(ferry::data_file_name(3, 1) == "rank-00003-0001.safetensors");
  REQUIRE(ferry::data_file_name(0, 0) == "rank-00000-0000.safetensors");
  REQUIRE(ferry::data_file_name(123456, 12345) == "rank-123456-12345.safetensors");
  REQUIRE(ferry::data_file_name("rank", 3, 1) == ferry::data_file_name(3, 1));
  REQUIRE(ferry::data_file_name("model.v2", 3, 1) == "model.v2-00003-0001.safetensors");
  REQUIRE(ferry::data_file_name("m", 0, 2, "ferryz") == "m-00000-0002.ferryz");
}

TEST_CASE("layout: header is aligned and chunks are back to back", "[layout]") {
  auto r = ferry::layout_file("rank-00000-0000.safetensors", sample_chunks());
  INFO(r.status().to_string());
  REQUIRE(r.ok());
  const auto& l = r.value();
  REQUIRE(l.name == "rank-00000-0000.safetensors");
  REQUIRE(l.header.size() % ferry::kDataAlignment == 0);
  REQUIRE(l.header.size() >= ferry::kDataAlignment);
  REQUIRE(read_le64(l.header) == l.header.size() - 8);
  REQUIRE(l.header[8] == '{');
  REQUIRE(contains(l.header, "\"__metadata__\":{\"format\":\"ferry\"}"));
  // Padding is trailing spaces after the closing brace.
  const size_t close = l.header.find_last_not_of(' ');
  REQUIRE(l.header[close] == '}');

  REQUIRE(l.chunks.size() == 6);
  const std::vector<uint64_t> lengths = {64, 64, 6, 8, 0, 7};
  uint64_t pos = l.header.size();
  for (size_t i = 0; i < l.chunks.size(); ++i) {
    REQUIRE(l.chunks[i].offset == pos);
    REQUIRE(l.chunks[i].length == lengths[i]);
    pos += lengths[i];
  }
  REQUIRE(l.size == pos);
  REQUIRE(l.chunks[1].entry == "model.w@4,0");
  REQUIRE(l.chunks[3].entry == "step@");
  REQUIRE(l.chunks[1].chunk.box.offsets == std::vector<int64_t>{4, 0});
}

TEST_CASE("layout: parse_safetensors_header reads back what layout_file wrote", "[layout]") {
  auto chunks = sample_chunks();
  chunks.push_back(chunk("odd \"key\"\\with\ttabs\x01 and \xc3\xa9t\xc3\xa9 \xf0\x9f\x9a\xa2",
                         DType::u8, {2}, {0}, {2}));
  auto l = ferry::layout_file("f", chunks);
  INFO(l.status().to_string());
  REQUIRE(l.ok());
  auto h = ferry::parse_safetensors_header(l->header, l->size);
  INFO(h.status().to_string());
  REQUIRE(h.ok());
  REQUIRE(h->data_start == l->header.size());
  REQUIRE(h->metadata == std::vector<std::pair<std::string, std::string>>{{"format", "ferry"}});
  REQUIRE(h->entries.size() == l->chunks.size());
  for (size_t i = 0; i < l->chunks.size(); ++i) {
    const auto& e = h->entries[i];
    const auto& c = l->chunks[i];
    REQUIRE(e.name == c.entry);
    REQUIRE(e.dtype == ferry::dtype_name(c.chunk.dtype));
    REQUIRE(e.shape == c.chunk.box.sizes);
    REQUIRE(e.begin + h->data_start == c.offset);
    REQUIRE(e.end - e.begin == c.length);
  }
}

TEST_CASE("layout: many chunks spill the header past one alignment unit", "[layout]") {
  std::vector<ChunkRef> chunks;
  for (int i = 0; i < 500; ++i)
    chunks.push_back(chunk("layers." + std::to_string(i) + ".weight", DType::bf16, {1024, 64},
                           {0, 0}, {1024, 64}));
  auto l = ferry::layout_file("f", chunks);
  REQUIRE(l.ok());
  REQUIRE(l->header.size() > ferry::kDataAlignment);
  REQUIRE(l->header.size() % ferry::kDataAlignment == 0);
  REQUIRE(l->size == l->header.size() + 500ull * 1024 * 64 * 2);
  auto h = ferry::parse_safetensors_header(l->header, l->size);
  INFO(h.status().to_string());
  REQUIRE(h.ok());
  REQUIRE(h->entries.size() == 500);
}

TEST_CASE("layout: an empty file is a valid safetensors file", "[layout]") {
  auto l = ferry::layout_file("f", {});
  REQUIRE(l.ok());
  REQUIRE(l->size == ferry::kDataAlignment);
  auto h = ferry::parse_safetensors_header(l->header, l->size);
  REQUIRE(h.ok());
  REQUIRE(h->entries.empty());
}

TEST_CASE("layout: bad chunks are invalid arguments naming them", "[layout]") {
  auto dup = ferry::layout_file(
      "f", {chunk("w", DType::f32, {4}, {0}, {2}), chunk("w", DType::f32, {4}, {0}, {2})});
  REQUIRE(dup.status().code() == StatusCode::invalid_argument);
  REQUIRE(contains(dup.status().message(), "'w@0'"));

  auto outside = ferry::layout_file("f", {chunk("w", DType::f32, {4}, {3}, {2})});
  REQUIRE(outside.status().code() == StatusCode::invalid_argument);
  REQUIRE(contains(outside.status().message(), "'w'"));

  auto rank = ferry::layout_file("f", {chunk("w", DType::f32, {4, 4}, {0}, {2})});
  REQUIRE(rank.status().code() == StatusCode::invalid_argument);
  REQUIRE(contains(rank.status().message(), "'w'"));

  auto utf8 = ferry::layout_file("f", {chunk("bad\xff", DType::f32, {1}, {0}, {1})});
  REQUIRE(utf8.status().code() == StatusCode::invalid_argument);
  REQUIRE(contains(utf8.status().message(), "UTF-8"));

  auto huge = ferry::layout_file("f", {chunk("h", DType::f64, {int64_t{1} << 40, int64_t{1} << 40},
                                             {0, 0}, {int64_t{1} << 40, int64_t{1} << 40})});
  REQUIRE(huge.status().code() == StatusCode::invalid_argument);
}

TEST_CASE("layout: hand-written valid headers parse", "[layout]") {
  // Whitespace, key order, escapes and no metadata are all fine.
  auto h = parse_json(
      "{ \"b\" : {\"shape\": [2], \"data_offsets\": [8, 16], \"dtype\": \"F32\"},\n"
      "  \"a\\u00e9\\ud83d\\ude80\": {\"dtype\":\"U8\",\"shape\":[2,4],\"data_offsets\":[0,8]} }  ",
      16);
  INFO(h.status().to_string());
  REQUIRE(h.ok());
  REQUIRE(h->entries.size() == 2);
  REQUIRE(h->entries[0].name == "a\xc3\xa9\xf0\x9f\x9a\x80");  // sorted by offset
  REQUIRE(h->entries[1].name == "b");
  REQUIRE(h->metadata.empty());
  REQUIRE(parse_json("{}", 0).ok());
}

TEST_CASE("layout: malformed headers are corruption", "[layout]") {
  const std::string ok_entry = "\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}";
  struct Case {
    std::string json;
    uint64_t data;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"{" + ok_entry, 8, "Missing a comma or '}'"},
      {"{" + ok_entry + "}}", 8, "after the header"},
      {"{" + ok_entry + ",}", 8, "Missing a name"},
      {"[1,2]", 0, "start with '{'"},
      {" {}", 0, "start with '{'"},
      {"{\"w\":{\"dtype\":\"F32,\"shape\":[2],\"data_offsets\":[0,8]}}", 8, ""},
      {"{\"w\x01\":{}}", 0, "control character"},
      {"{\"w\\q\":{}}", 0, "Invalid escape"},
      {"{\"\\ud800\":{}}", 0, "surrogate"},
      {"{\"\xc0\xaf\":{}}", 0, "Invalid encoding"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[02],\"data_offsets\":[0,8]}}", 8,
       "Missing a comma or ']'"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, "negative"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]}}", 8, "not an integer"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,99999999999999999999]}}", 8,
       "64 bits"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8, "expected 2"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "no data_offsets"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}", 8,
       "unexpected field 'x'"},
      {"{\"w\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
       "repeated"},
      {"{\"w\":[]}", 0, "not an object"},
      {"{\"__metadata__\":{\"a\":1}}", 0, "not a string"},
      {"{\"__metadata__\":{\"a\":\"1\",\"a\":\"2\"}}", 0, "duplicate __metadata__ key"},
      // Semantics.
      {"{\"w\":{\"dtype\":\"F33\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "unknown dtype"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, "span 8"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, "reversed"},
      {"{" + ok_entry + "," + ok_entry + "}", 8, "duplicate name 'w'"},
      {"{" + ok_entry + ",\"v\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12,
       "overlap"},
      {"{" + ok_entry + ",\"v\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}", 20,
       "gap"},
      {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, "gap"},
      {"{" + ok_entry + "}", 9, "file holds 9"},
      {"{" + ok_entry + "}", 8 - 1, "file holds 7"},
      {"{\"w\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,0]}}", 0,
       "overflows"},
  };
  for (const auto& c : cases) {
    auto r = parse_json(c.json, c.data);
    INFO(c.json << " -> " << r.status().to_string());
    REQUIRE(r.status().code() == StatusCode::corruption);
    REQUIRE(contains(r.status().message(), c.expect));
  }
}

TEST_CASE("layout: bad header lengths are corruption", "[layout]") {
  auto l = ferry::layout_file("f", sample_chunks());
  REQUIRE(l.ok());
  const std::string& good = l->header;

  REQUIRE(ferry::parse_safetensors_header("", 100).status().code() == StatusCode::corruption);
  REQUIRE(ferry::parse_safetensors_header(good.substr(0, 7), l->size).status().code() ==
          StatusCode::corruption);
  REQUIRE(ferry::parse_safetensors_header(good, 7).status().code() == StatusCode::corruption);
  // The prefix stops short of the header.
  auto short_prefix = ferry::parse_safetensors_header(good.substr(0, 100), l->size);
  REQUIRE(short_prefix.status().code() == StatusCode::corruption);
  // The file is shorter than the header claims.
  REQUIRE(ferry::parse_safetensors_header(good, good.size() - 1).status().code() ==
          StatusCode::corruption);

  std::string huge = good;
  for (int i = 0; i < 8; ++i) huge[i] = '\xff';
  auto r = ferry::parse_safetensors_header(huge, l->size);
  REQUIRE(r.status().code() == StatusCode::corruption);
  REQUIRE(contains(r.status().message(), "exceeds the limit"));

  std::string big = good;
  const uint64_t n = 200'000'000;
  for (int i = 0; i < 8; ++i) big[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  REQUIRE(ferry::parse_safetensors_header(big, uint64_t{1} << 40).status().code() ==
          StatusCode::corruption);

  std::string zero = good;
  for (int i = 0; i < 8; ++i) zero[i] = 0;
  REQUIRE(ferry::parse_safetensors_header(zero, l->size).status().code() == StatusCode::corruption);
}

TEST_CASE("layout: every single-byte change of a header parses or fails cleanly", "[layout]") {
  auto l = ferry::layout_file("f", sample_chunks());
  REQUIRE(l.ok());
  // Only the JSON text up to the padding is interesting.
  const size_t end = l->header.find_last_not_of(' ') + 2;
  size_t rejected = 0;
  for (size_t i = 0; i < end; ++i) {
    for (unsigned mask : {0x01u, 0x20u, 0x80u}) {
      std::string bad = l->header;
      bad[i] = static_cast<char>(static_cast<unsigned char>(bad[i]) ^ mask);
      auto r = ferry::parse_safetensors_header(bad, l->size);
      if (!r.ok()) {
        ++rejected;
        REQUIRE(r.status().code() == StatusCode::corruption);
      }
    }
  }
  // Flips inside names and some whitespace survive; most do not.
  REQUIRE(rejected > end);
}

TEST_CASE("layout: random garbage never crashes the parser", "[layout]") {
  std::mt19937_64 rng(20240601);
  auto l = ferry::layout_file("f", sample_chunks());
  REQUIRE(l.ok());
  const std::string alphabet = "{}[]:,\"\\u0123456789abcdefFIU_-.eE \t\n";
  for (int iter = 0; iter < 20000; ++iter) {
    std::string s;
    const size_t len = rng() % 300;
    const int mode = static_cast<int>(rng() % 3);
    for (size_t i = 0; i < len; ++i) {
      if (mode == 0)
        s += static_cast<char>(rng() & 0xff);
      else
        s += alphabet[rng() % alphabet.size()];
    }
    if (mode == 2) {
      // Splice a piece of a valid header into JSON-ish noise.
      const size_t from = 8 + rng() % 200;
      s = l->header.substr(8, from - 8) + s;
    }
    std::string h = (mode == 0) ? s : header_of(s);
    const uint64_t file_size = h.size() + rng() % 128;
    auto r = ferry::parse_safetensors_header(h, file_size);
    if (!r.ok()) REQUIRE(r.status().code() == StatusCode::corruption);
  }
}

TEST_CASE("layout: pack_into_files keeps every byte once and respects shard_size", "[layout]") {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 200; ++round) {
    std::vector<ChunkRef> in;
    const int n = 1 + static_cast<int>(rng() % 6);
    for (int i = 0; i < n; ++i) {
      const int64_t rows = static_cast<int64_t>(rng() % 40),
                    cols = 1 + static_cast<int64_t>(rng() % 9);
      in.push_back(chunk("t" + std::to_string(i), i % 2 ? DType::bf16 : DType::f32,
                         {rows + 3, cols}, {3, 0}, {rows, cols}));
    }
    in.push_back(chunk("scalar", DType::i64, {}, {}, {}));
    const uint64_t cap = 8 + rng() % 300;
    const auto files = ferry::pack_into_files(in, cap);
    std::vector<uint64_t> covered(in.size(), 0);
    for (const auto& f : files) {
      REQUIRE_FALSE(f.empty());
      uint64_t bytes = 0;
      for (const auto& p : f) {
        const ChunkRef& src = in[p.source];
        bytes += p.chunk.nbytes();
        // The piece is a dim-0 slice of its source, at the byte offset `skip`.
        REQUIRE(p.skip == covered[p.source]);
        if (!src.box.sizes.empty()) {
          const uint64_t row = src.box.sizes[0] ? src.nbytes() / src.box.sizes[0] : 0;
          if (row) REQUIRE(p.chunk.box.offsets[0] == src.box.offsets[0] + int64_t(p.skip / row));
          REQUIRE(std::vector<int64_t>(p.chunk.box.sizes.begin() + 1, p.chunk.box.sizes.end()) ==
                  std::vector<int64_t>(src.box.sizes.begin() + 1, src.box.sizes.end()));
        }
        covered[p.source] += p.chunk.nbytes();
      }
      // Over the cap only when one unsplittable row is alone in its file.
      if (bytes > cap) {
        REQUIRE(f.size() == 1);
        REQUIRE((f[0].chunk.box.sizes.size() <= 1 || f[0].chunk.box.sizes[0] == 1));
      }
    }
    for (size_t i = 0; i < in.size(); ++i) REQUIRE(covered[i] == in[i].nbytes());
  }
  // No cap: one file holding the chunks unchanged.
  const auto one = ferry::pack_into_files(sample_chunks(), 0);
  REQUIRE(one.size() == 1);
  REQUIRE(one[0].size() == sample_chunks().size());
  // A 4 KiB item under a 1000-byte cap: five files, split at row boundaries.
  const auto split =
      ferry::pack_into_files({chunk("w", DType::f32, {64, 16}, {0, 0}, {64, 16})}, 1000);
  REQUIRE(split.size() == 5);
  REQUIRE(split[0][0].chunk.box.sizes == std::vector<int64_t>{15, 16});
  REQUIRE(split[4][0].chunk.box.offsets == std::vector<int64_t>{60, 0});
  REQUIRE(split[4][0].chunk.box.sizes == std::vector<int64_t>{4, 16});
  REQUIRE(split[4][0].skip == 60 * 64);
}

TEST_CASE("layout: pack_into_files counts each piece's worst stored size", "[layout]") {
  // Stored size = raw + 10% + 7 per piece, as a codec's worst case might be.
  auto stored = [](uint64_t raw) { return raw + raw / 10 + 7; };
  std::vector<ChunkRef> in = {chunk("a", DType::f32, {50, 4}, {0, 0}, {50, 4}),
                              chunk("b", DType::u8, {3}, {0}, {3}),
                              chunk("c", DType::bf16, {400}, {0}, {400})};
  const auto files = ferry::pack_into_files(in, 300, stored);
  std::vector<uint64_t> covered(in.size(), 0);
  for (const auto& f : files) {
    uint64_t bytes = 0;
    for (const auto& p : f) {
      bytes += stored(p.chunk.nbytes());
      covered[p.source] += p.chunk.nbytes();
    }
    REQUIRE(bytes <= 300);
  }
  for (size_t i = 0; i < in.size(); ++i) REQUIRE(covered[i] == in[i].nbytes());
}
