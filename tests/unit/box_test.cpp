#include "box.hpp"

#include <catch2/catch.hpp>

#include <random>
#include <tuple>
#include <vector>

using ferry::Box;

namespace {

using Run = std::tuple<int64_t, int64_t, int64_t>;

std::vector<Run> runs_of(const Box& region, const Box& src, const Box& dst) {
  std::vector<Run> out;
  ferry::for_each_run(region, src, dst,
                      [&](int64_t s, int64_t d, int64_t n) { out.emplace_back(s, d, n); });
  return out;
}

// Element by element, then merged wherever both sides continue: the
// definition of maximal runs, independent of the implementation's shortcut.
std::vector<Run> reference_runs(const Box& region, const Box& src, const Box& dst) {
  std::vector<Run> out;
  if (region.empty()) return out;
  const size_t r = region.rank();
  std::vector<int64_t> idx(r, 0);
  while (true) {
    int64_t s = 0, d = 0;
    for (size_t k = 0; k < r; ++k) {
      s = s * src.sizes[k] + (region.offsets[k] + idx[k] - src.offsets[k]);
      d = d * dst.sizes[k] + (region.offsets[k] + idx[k] - dst.offsets[k]);
    }
    if (!out.empty() && std::get<0>(out.back()) + std::get<2>(out.back()) == s &&
        std::get<1>(out.back()) + std::get<2>(out.back()) == d) {
      ++std::get<2>(out.back());
    } else {
      out.emplace_back(s, d, 1);
    }
    size_t k = r;
    while (k > 0) {
      --k;
      if (++idx[k] < region.sizes[k]) break;
      idx[k] = 0;
      if (k == 0) return out;
    }
    if (r == 0) return out;
  }
}

}  // namespace

TEST_CASE("Box basics", "[box]") {
  Box b{{1, 2}, {3, 4}};
  CHECK(b.rank() == 2);
  CHECK(b.numel() == 12);
  CHECK_FALSE(b.empty());
  CHECK(b.to_string() == "[1:4, 2:6]");

  Box scalar;
  CHECK(scalar.rank() == 0);
  CHECK(scalar.numel() == 1);
  CHECK_FALSE(scalar.empty());
  CHECK(scalar.to_string() == "[]");

  CHECK(Box{{0, 0}, {0, 5}}.empty());

  CHECK(Box::whole({4096, 128}) == Box{{0, 0}, {4096, 128}});
  CHECK(Box::whole({4096, 128}).to_string() == "[0:4096, 0:128]");
  CHECK(Box::whole({}) == Box{});
}

TEST_CASE("Box ordering is by offsets, then sizes", "[box]") {
  CHECK(Box{{0, 5}, {9, 9}} < Box{{1, 0}, {1, 1}});
  CHECK(Box{{1, 0}, {1, 1}} < Box{{1, 0}, {1, 2}});
  CHECK_FALSE(Box{{1, 0}, {1, 2}} < Box{{1, 0}, {1, 2}});
  CHECK(Box{{1, 0}, {1, 2}} != Box{{1, 0}, {2, 2}});
}

TEST_CASE("Box contains", "[box]") {
  Box outer{{2, 2}, {4, 4}};
  CHECK(outer.contains(outer));
  CHECK(outer.contains(Box{{3, 3}, {2, 3}}));
  CHECK_FALSE(outer.contains(Box{{1, 3}, {2, 2}}));
  CHECK_FALSE(outer.contains(Box{{3, 3}, {2, 4}}));
  CHECK_FALSE(outer.contains(Box{{3}, {1}}));
  CHECK(Box{}.contains(Box{}));
}

TEST_CASE("intersect", "[box]") {
  auto i = ferry::intersect(Box{{0, 0}, {4, 4}}, Box{{2, 1}, {4, 2}});
  REQUIRE(i);
  CHECK(*i == Box{{2, 1}, {2, 2}});

  CHECK_FALSE(ferry::intersect(Box{{0, 0}, {4, 4}}, Box{{4, 0}, {4, 4}}));  // touching
  CHECK_FALSE(ferry::intersect(Box{{0, 0}, {4, 4}}, Box{{1, 1}, {0, 2}}));  // empty
  CHECK_FALSE(ferry::intersect(Box{{0}, {4}}, Box{{0, 0}, {4, 4}}));        // rank
  auto s = ferry::intersect(Box{}, Box{});
  REQUIRE(s);
  CHECK(s->numel() == 1);
}

TEST_CASE("for_each_run merges trailing full dimensions", "[box]") {
  // Rows of a 2-D tensor: one run.
  Box whole = Box::whole({4, 8});
  CHECK(runs_of(Box{{1, 0}, {2, 8}}, whole, Box{{1, 0}, {2, 8}}) == std::vector<Run>{{8, 0, 16}});
  // A column slice: one run per row.
  CHECK(runs_of(Box{{0, 2}, {4, 3}}, whole, Box{{0, 2}, {4, 3}}) ==
        std::vector<Run>{{2, 0, 3}, {10, 3, 3}, {18, 6, 3}, {26, 9, 3}});
  // Full in src but not dst: rows cannot merge.
  CHECK(runs_of(Box{{0, 0}, {2, 8}}, whole, Box{{0, 0}, {2, 16}}) ==
        std::vector<Run>{{0, 0, 8}, {8, 16, 8}});
  // 0-d: one element.
  CHECK(runs_of(Box{}, Box{}, Box{}) == std::vector<Run>{{0, 0, 1}});
  // Empty region: nothing.
  CHECK(runs_of(Box{{0, 0}, {0, 8}}, whole, whole).empty());
  // 3-D with an inner full plane: one run per outer index.
  Box t3 = Box::whole({3, 4, 5});
  CHECK(runs_of(Box{{0, 1, 0}, {3, 2, 5}}, t3, Box{{0, 1, 0}, {3, 2, 5}}) ==
        std::vector<Run>{{5, 0, 10}, {25, 10, 10}, {45, 20, 10}});
}

TEST_CASE("for_each_run matches an element-wise reference on random boxes", "[box]") {
  std::mt19937 rng(1234);
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int iter = 0; iter < 2000; ++iter) {
    const auto rank = static_cast<size_t>(pick(0, 4));
    Box src, dst, region;
    for (size_t k = 0; k < rank; ++k) {
      const int64_t n = pick(1, 6);
      // Two boxes inside [0, n), their intersection as the region.
      auto sub = [&](Box& b) {
        int64_t a = pick(0, n - 1), e = pick(a + 1, n);
        if (pick(0, 2) == 0) a = 0, e = n;
        b.offsets.push_back(a);
        b.sizes.push_back(e - a);
      };
      sub(src);
      sub(dst);
    }
    auto i = ferry::intersect(src, dst);
    if (!i) continue;
    region = *i;
    // Sometimes shrink the region further.
    for (size_t k = 0; k < rank; ++k) {
      if (pick(0, 3) == 0 && region.sizes[k] > 1) {
        region.offsets[k] += 1;
        region.sizes[k] -= 1;
      }
    }
    INFO("region " << region.to_string() << " src " << src.to_string() << " dst "
                   << dst.to_string());
    CHECK(runs_of(region, src, dst) == reference_runs(region, src, dst));
  }
}

TEST_CASE("for_each_run costs one call per run, not per element", "[box]") {
  Box big = Box::whole({1 << 20, 1 << 12});  // 4 Gi elements
  int64_t calls = 0, elems = 0;
  ferry::for_each_run(big, big, big, [&](int64_t, int64_t, int64_t n) {
    ++calls;
    elems += n;
  });
  CHECK(calls == 1);
  CHECK(elems == (int64_t{1} << 32));
}
