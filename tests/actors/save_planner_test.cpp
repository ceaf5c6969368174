// SavePlanner (ferry/planner.hpp) on one rank, end to end through the real
// actors: the steps give the same files as save_async, the step defaults,
// the local plan hook, and the steps taken in a wrong order.

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>

#include "catalog.hpp"
#include "ferry/planner.hpp"
#include "ferry/runtime.hpp"
#include "layout.hpp"
#include "runtime_rig.hpp"
#include "safetensors_writer.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using ferry::Status;
using ferry::testing::TempDir;

namespace {

std::unique_ptr<ferry::Runtime> make_runtime(const std::string& root,
                                             const std::string& write_timeout = "30s") {
  return ferry::testing::make_test_runtime(root, {{{"write-timeout", write_timeout}}});
}

struct Model {
  std::vector<float> w = std::vector<float>(64 * 32);
  std::vector<float> b = std::vector<float>(64);
  ferry::StateDict sd;
  explicit Model(uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (auto& x : w) x = static_cast<float>(rng() % 1000);
    for (auto& x : b) x = static_cast<float>(rng() % 1000);
    REQUIRE(sd.add("layer.w", {w.data(), ferry::DType::f32, {64, 32}}).ok());
    REQUIRE(sd.add("layer.b", {b.data(), ferry::DType::f32, {64}}).ok());
  }
};

std::string slurp(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

// create_global_plan, save_on_this_process, barrier.
ferry::Result<std::string> run_steps(ferry::SavePlanner& p, int32_t rank = 0) {
  auto global = p.create_global_plan();
  if (!global.ok()) return global.status();
  auto wrote = p.save_on_this_process((*global)[rank]);
  if (Status s = wrote.wait(); !s.ok()) return s;
  return p.barrier();
}

// save_on_this_process with the plan create_global_plan gave, then barrier.
ferry::Result<std::string> run_steps_from(ferry::SavePlanner& p, const ferry::SavePlan& plan) {
  if (Status s = p.save_on_this_process(plan).wait(); !s.ok()) return s;
  return p.barrier();
}

}  // namespace

TEST_CASE("the planner's steps write what save_async writes, and the step defaults to latest + 1",
          "[planner_api]") {
  TempDir d;
  auto rt = make_runtime(d.path());
  Model m(1);
  ferry::SavePlanner first(*rt, m.sd);
  CHECK(first.step() == 0);  // an empty root
  auto global = first.create_global_plan();
  REQUIRE(global.ok());
  REQUIRE(global->size() == 1);
  const ferry::SavePlan& plan = (*global)[0];
  CHECK(plan.bytes == (64 * 32 + 64) * 4);
  CHECK(plan.files == std::vector<std::string>{"rank-00000-0000.safetensors"});
  const std::string text = plan.to_string();
  CHECK_THAT(text, Catch::Contains("\"layer.w\"") && Catch::Contains("written by rank 0") &&
                       Catch::Contains("rank-00000-0000.safetensors") && Catch::Contains("8448 B"));
  // Nothing is written before save_on_this_process.
  CHECK(ferry::list_checkpoints(*ferry::posix_filesystem(), d.path())->empty());
  auto wrote = first.save_on_this_process(plan);
  REQUIRE(wrote.wait().ok());
  auto path = first.barrier();
  REQUIRE(path.ok());
  CHECK(*path == rt->latest());

  auto h = rt->save_async(m.sd, 7);
  REQUIRE(h.wait_committed().ok());
  const std::string name = "/rank-00000-0000.safetensors";
  CHECK(slurp(*path + name) == slurp(h.path() + name));
  CHECK_FALSE(slurp(*path + name).empty());

  ferry::SavePlanner next(*rt, m.sd);
  CHECK(next.step() == 8);
  auto again = run_steps(next);
  REQUIRE(again.ok());
  CHECK(ferry::find_latest(*ferry::posix_filesystem(), d.path())->step == 8);

  // It loads like any checkpoint.
  Model back(2);
  REQUIRE(rt->load(back.sd, *again).ok());
  CHECK(back.w == m.w);
  CHECK(back.b == m.b);
}

TEST_CASE("the local plan hook drops and renames items before the plan is sent", "[planner_api]") {
  TempDir d;
  auto rt = make_runtime(d.path());
  Model m(3);
  ferry::SavePlannerOptions o;
  o.transform_local_plan = [](ferry::LocalSavePlan& p) {
    p.items.erase(p.items.begin() + 1);  // layer.b is not saved
    p.items[0].key = "renamed.w";
    return Status();
  };
  ferry::SavePlanner planner(*rt, m.sd, "rank", o, "", 3);
  auto local = planner.create_local_plan();
  REQUIRE(local.ok());
  REQUIRE(local->items.size() == 1);
  CHECK(local->items[0].key == "renamed.w");
  auto path = run_steps(planner);
  REQUIRE(path.ok());

  std::vector<float> w(64 * 32);
  ferry::StateDict want;
  REQUIRE(want.add("renamed.w", {w.data(), ferry::DType::f32, {64, 32}}).ok());
  REQUIRE(rt->load(want, *path).ok());
  CHECK(w == m.w);
  std::vector<float> b(64);
  ferry::StateDict old;
  REQUIRE(old.add("layer.b", {b.data(), ferry::DType::f32, {64}}).ok());
  auto missing = rt->load(old, *path);
  CHECK_THAT(missing.message(), Catch::Contains("layer.b"));

  // A hook that changes more than keys is refused, naming the item.
  ferry::SavePlannerOptions bad;
  bad.transform_local_plan = [](ferry::LocalSavePlan& p) {
    p.items[0].sizes[0] = 1;
    return Status();
  };
  ferry::SavePlanner refused(*rt, m.sd, "", bad, "", 4);
  auto g = refused.create_global_plan();
  REQUIRE_FALSE(g.ok());
  CHECK_THAT(g.status().message(),
             Catch::Contains("\"layer.w\"") && Catch::Contains("only the key"));
  CHECK(refused.handle().wait_committed(std::chrono::seconds(10)).code() !=
        ferry::StatusCode::timeout);
  CHECK_FALSE(fs::exists(d.path() + "/step-00000004"));
  // The runtime saves on afterwards.
  auto h = rt->save_async(m.sd, 5);
  CHECK(h.wait_committed().ok());
}

TEST_CASE("steps out of order are refused with a clear error and leave nothing committed",
          "[planner_api]") {
  TempDir d;
  auto rt = make_runtime(d.path());
  Model m(4);
  {
    ferry::SavePlanner p(*rt, m.sd, "", {}, "", 1);
    auto global = p.create_global_plan();
    REQUIRE(global.ok());
    // Another rank's plan: refused, and the checkpoint goes on.
    ferry::SavePlan other = (*global)[0];
    other.rank = 1;
    auto refused = p.save_on_this_process(other);
    Status s = refused.wait();
    CHECK_THAT(s.message(), Catch::Contains("rank 1's plan") && Catch::Contains("on rank 0"));
    // A plan that is not the one rank 0 made: refused too.
    ferry::SavePlan edited = (*global)[0];
    edited.writes.pop_back();
    CHECK_THAT(p.save_on_this_process(edited).wait().message(),
               Catch::Contains("differs from this rank's part"));
    REQUIRE(p.save_on_this_process((*global)[0]).wait().ok());
    auto path = p.barrier();
    REQUIRE(path.ok());
  }
  {
    ferry::SavePlanner p(*rt, m.sd, "", {}, "", 2);
    REQUIRE(p.create_global_plan().ok());
    auto r = p.barrier();  // never wrote
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status().message(), Catch::Contains("before save_on_this_process"));
  }
  CHECK_FALSE(fs::exists(d.path() + "/step-00000002"));
  {
    ferry::SavePlanner p(*rt, m.sd, "prefix/with/slash");
    auto r = p.create_global_plan();
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status().message(), Catch::Contains("filename_prefix"));
  }
  {
    // A good prefix names the data files.
    ferry::SavePlanner p(*rt, m.sd, "model_v3", {}, "", 3);
    auto g = p.create_global_plan();
    REQUIRE(g.ok());
    REQUIRE(p.save_on_this_process((*g)[0]).wait().ok());
    auto path = p.barrier();
    REQUIRE(path.ok());
    CHECK(fs::exists(*path + "/model_v3-00000-0000.safetensors"));
  }
}

TEST_CASE("a rank that never reaches barrier() aborts the checkpoint at write-timeout",
          "[planner_api]") {
  TempDir d;
  auto rt = make_runtime(d.path(), "2s");
  Model m(5);
  ferry::SavePlanner p(*rt, m.sd, "", {}, "", 1);
  auto global = p.create_global_plan();
  REQUIRE(global.ok());
  REQUIRE(p.save_on_this_process((*global)[0]).wait().ok());
  const auto t0 = std::chrono::steady_clock::now();
  Status s = p.handle().wait_committed(std::chrono::seconds(20));
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(s.code() == ferry::StatusCode::timeout);
  CHECK_THAT(s.message(), Catch::Contains("write phase timed out"));
  CHECK(waited < 10);
  CHECK(ferry::list_checkpoints(*ferry::posix_filesystem(), d.path())->empty());
}

TEST_CASE("a checkpoint_fn gets exactly the planned tensors and its file is committed",
          "[planner_api][checkpoint_fn]") {
  TempDir d;
  auto rt = make_runtime(d.path());
  Model m(6);
  std::vector<std::string> keys;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<std::string> bytes;
  std::string wrote_to;
  ferry::SavePlannerOptions o;
  o.checkpoint_fn = [&](const ferry::StateDict& planned, const std::string& filename) {
    for (const auto& e : planned.entries()) {
      keys.push_back(e.key);
      shapes.push_back(e.view.shape);
      bytes.emplace_back(static_cast<const char*>(e.view.data), e.view.nbytes());
    }
    wrote_to = filename;
    return ferry::testing::write_safetensors(planned, filename);
  };
  ferry::SavePlanner p(*rt, m.sd, "", o);
  auto global = p.create_global_plan();
  REQUIRE(global.ok());
  REQUIRE(p.save_on_this_process((*global)[0]).wait().ok());
  // Exactly the plan's writes: names, shapes and the caller's bytes.
  const ferry::SavePlan& plan = (*global)[0];
  REQUIRE(keys.size() == plan.writes.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto& w = plan.writes[i];
    CHECK(keys[i].rfind(plan.items[w.item].key + "@", 0) == 0);
    CHECK(shapes[i] == w.sizes);
  }
  CHECK(bytes[0] == std::string(reinterpret_cast<const char*>(m.w.data()), m.w.size() * 4));
  CHECK(bytes[1] == std::string(reinterpret_cast<const char*>(m.b.data()), m.b.size() * 4));
  CHECK_THAT(wrote_to, Catch::EndsWith("/rank-00000-0000.safetensors"));
  auto path = p.barrier();
  REQUIRE(path.ok());
  // The checksums Ferry recorded hold for what the function wrote.
  CHECK(rt->latest_valid() == *path);
  Model back(7);
  REQUIRE(rt->load(back.sd, *path).ok());
  CHECK(back.w == m.w);
  CHECK(back.b == m.b);
}

TEST_CASE("a checkpoint_fn gets strided tensors as contiguous host copies",
          "[planner_api][checkpoint_fn]") {
  TempDir d;
  auto rt = make_runtime(d.path());
  // A 6x5 matrix seen through two strided views: columns 1..3, and its
  // transpose.
  std::vector<float> base(6 * 5);
  for (size_t i = 0; i < base.size(); ++i) base[i] = static_cast<float>(i) * 0.5f;
  ferry::StateDict sd;
  REQUIRE(sd.add("cols", ferry::TensorView(base.data() + 1, ferry::DType::f32, {6, 3},
                                           ferry::Device::host(), {5, 1}))
              .ok());
  REQUIRE(sd.add("t", ferry::TensorView(base.data(), ferry::DType::f32, {5, 6},
                                        ferry::Device::host(), {1, 5}))
              .ok());
  std::vector<float> want_cols, want_t;
  for (int r = 0; r < 6; ++r)
    for (int c = 1; c < 4; ++c) want_cols.push_back(base[r * 5 + c]);
  for (int r = 0; r < 5; ++r)
    for (int c = 0; c < 6; ++c) want_t.push_back(base[c * 5 + r]);
  std::map<std::string, std::vector<float>> got;
  ferry::SavePlannerOptions o;
  o.checkpoint_fn = [&](const ferry::StateDict& planned, const std::string& filename) {
    for (const auto& e : planned.entries()) {
      if (!e.view.device.is_host() || !e.view.is_contiguous())
        return Status::internal("handed a view it cannot read in place: " + e.key);
      const auto* f = static_cast<const float*>(e.view.data);
      got[e.key.substr(0, e.key.find('@'))].assign(f, f + e.view.numel());
    }
    return ferry::testing::write_safetensors(planned, filename);
  };
  ferry::SavePlanner p(*rt, sd, "", o);
  auto global = p.create_global_plan();
  REQUIRE(global.ok());
  REQUIRE(p.save_on_this_process((*global)[0]).wait().ok());
  CHECK(got["cols"] == want_cols);
  CHECK(got["t"] == want_t);
  auto path = p.barrier();
  REQUIRE(path.ok());
  CHECK(rt->latest_valid() == *path);
  std::vector<float> cols(want_cols.size()), t(want_t.size());
  ferry::StateDict back;
  REQUIRE(back.add("cols", {cols.data(), ferry::DType::f32, {6, 3}}).ok());
  REQUIRE(back.add("t", {t.data(), ferry::DType::f32, {5, 6}}).ok());
  REQUIRE(rt->load(back, *path).ok());
  CHECK(cols == want_cols);
  CHECK(t == want_t);
}

TEST_CASE("a checkpoint_fn that fails, throws or writes nothing aborts the checkpoint",
          "[planner_api][checkpoint_fn]") {
  TempDir d;
  auto rt = make_runtime(d.path());
  Model m(8);
  struct Case {
    const char* what;
    ferry::CheckpointFn fn;
    const char* says;
  };
  const Case cases[] = {
      {"fails",
       [](const ferry::StateDict&, const std::string&) { return Status::io_error("disk on fire"); },
       "disk on fire"},
      {"throws",
       [](const ferry::StateDict&, const std::string&) -> Status {
         throw std::runtime_error("user bug");
       },
       "raised: user bug"},
      {"writes nothing", [](const ferry::StateDict&, const std::string&) { return Status(); },
       "wrote nothing"},
      {"writes too little",
       [](const ferry::StateDict& planned, const std::string& f) {
         ferry::StateDict less;
         (void)less.add(planned.entries()[0].key, planned.entries()[0].view);
         return ferry::testing::write_safetensors(less, f);
       },
       "without planned tensor"},
  };
  uint64_t step = 1;
  for (const Case& c : cases) {
    INFO(c.what);
    ferry::SavePlannerOptions o;
    o.checkpoint_fn = c.fn;
    ferry::SavePlanner p(*rt, m.sd, "", o, "", step++);
    auto global = p.create_global_plan();
    REQUIRE(global.ok());
    Status wrote = p.save_on_this_process((*global)[0]).wait();
    CHECK_THAT(wrote.message(), Catch::Contains(c.says) && Catch::Contains("rank 0"));
    auto r = p.barrier();
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(r.status().message(), Catch::Contains(c.says));
  }
  CHECK(ferry::list_checkpoints(*ferry::posix_filesystem(), d.path())->empty());
  for (auto& e : fs::directory_iterator(d.path()))
    CHECK_FALSE(ferry::is_pending_dir_name(e.path().filename().string()));
}

namespace {

// The data files of a committed checkpoint, by name (MANIFEST, LEASE and
// the like are not data files).
std::vector<std::string> data_files_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.find(".safetensors") != std::string::npos || name.find(".ferryz") != std::string::npos)
      out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The entry names in a data file's header (compressed files have one too).
std::set<std::string> entries_in(const std::string& path) {
  const std::string bytes = slurp(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  auto h = ferry::parse_safetensors_header(bytes.substr(0, 8 + n), bytes.size());
  REQUIRE(h.ok());
  std::set<std::string> out;
  for (const auto& e : h->entries) out.insert(e.name);
  return out;
}

// What the plan puts in each of its files: "key@offsets" entry names.
std::map<std::string, std::set<std::string>> planned_entries(const ferry::SavePlan& plan) {
  std::map<std::string, std::set<std::string>> out;
  for (const auto& f : plan.files) out[f];
  for (const auto& w : plan.writes)
    out[plan.files[w.file]].insert(
        ferry::entry_name(plan.items[w.item].key, ferry::Box{w.offsets, w.sizes}));
  return out;
}

// A tensor zstd shrinks (the frames' ends then differ from the raw sizes),
// one that it does not, a small one and a 0-d one.
struct MatrixModel {
  std::vector<float> big = std::vector<float>(256 * 1024);
  std::vector<uint8_t> noise = ferry::testing::random_bytes(96 * 1024, 5);
  std::vector<float> b = std::vector<float>(64);
  int64_t step = 0;
  ferry::StateDict sd;
  explicit MatrixModel(int seed) {
    for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>((i * 7 + seed) % 97);
    for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(i + seed);
    step = seed;
    REQUIRE(sd.add("model.big.weight", {big.data(), ferry::DType::f32, {256, 1024}}).ok());
    REQUIRE(sd.add("model.noise", {noise.data(), ferry::DType::u8, {96, 1024}}).ok());
    REQUIRE(sd.add("layer.b", {b.data(), ferry::DType::f32, {64}}).ok());
    REQUIRE(sd.add("step", {&step, ferry::DType::i64, {}}).ok());
  }
};

}  // namespace

TEST_CASE(
    "every combination of compress, shard_size, prefix and checkpoint_fn commits what the "
    "plan names, and it loads",
    "[planner_api][checkpoint_fn][plan_files]") {
  TempDir d;
  auto rt = make_runtime(d.path());
  MatrixModel m(3);
  uint64_t step = 0;
  for (const char* compress : {"none", "zstd"})
    for (int64_t shard : {int64_t{0}, int64_t{1} << 18})
      for (const char* prefix : {"", "model_v3"})
        for (bool with_fn : {false, true}) {
          INFO("compress " << compress << ", shard_size " << shard << ", prefix '" << prefix
                           << "', checkpoint_fn " << with_fn);
          ferry::SavePlannerOptions o;
          o.save.compress = compress;
          if (shard > 0) o.save.shard_size = shard;
          std::vector<std::string> fn_files;
          if (with_fn)
            o.checkpoint_fn = [&fn_files](const ferry::StateDict& sd, const std::string& f) {
              fn_files.push_back(fs::path(f).filename().string());
              return ferry::testing::write_safetensors(sd, f);
            };
          ferry::SavePlanner p(*rt, m.sd, prefix, o, "", step++);
          auto global = p.create_global_plan();
          REQUIRE(global.ok());
          const ferry::SavePlan plan = (*global)[0];
          auto path = run_steps_from(p, plan);
          INFO(path.status().to_string());
          REQUIRE(path.ok());
          // The plan's files are the files written, holding exactly its items.
          std::vector<std::string> want = plan.files;
          std::sort(want.begin(), want.end());
          CHECK(data_files_in(*path) == want);
          const std::string stem = std::string(*prefix ? prefix : "rank") + "-00000-";
          const bool zipped = std::string(compress) == "zstd" && !with_fn;
          for (const auto& [file, entries] : planned_entries(plan)) {
            CHECK(file.rfind(stem, 0) == 0);
            CHECK_THAT(file, Catch::EndsWith(zipped ? ".ferryz" : ".safetensors"));
            CHECK(entries_in(*path + "/" + file) == entries);
            CHECK_THAT(plan.to_string(), Catch::Contains("-> " + file));
          }
          if (shard > 0) CHECK(plan.files.size() >= 4);  // the cap split the tensors
          if (with_fn) CHECK(fn_files == plan.files);
          MatrixModel back(11);
          REQUIRE(rt->load(back.sd, *path).ok());
          CHECK(back.big == m.big);
          CHECK(back.noise == m.noise);
          CHECK(back.b == m.b);
          CHECK(back.step == m.step);
        }
}

TEST_CASE("a checkpoint_fn that writes torch.save output fails the save, naming the format",
          "[planner_api][checkpoint_fn]") {
  TempDir d;
  auto rt = make_runtime(d.path());
  MatrixModel m(4);
  ferry::SavePlannerOptions o;
  o.checkpoint_fn = [](const ferry::StateDict&, const std::string& f) {
    std::ofstream(f, std::ios::binary) << std::string("PK\x03\x04", 4) << std::string(200, 'x');
    return Status();
  };
  ferry::SavePlanner p(*rt, m.sd, "", o);
  auto path = run_steps(p);
  REQUIRE_FALSE(path.ok());
  CHECK_THAT(path.status().message(), Catch::Contains("rank-00000-0000.safetensors") &&
                                          Catch::Contains("torch.save") &&
                                          Catch::Contains("safetensors.torch.save_file"));
  CHECK(ferry::list_checkpoints(*ferry::posix_filesystem(), d.path())->empty());
}

TEST_CASE("with no root anywhere, the prefix's directory is the root and its last part the prefix",
          "[planner_api]") {
  TempDir d;
  // No root configured: the runtime's rig sets one, so this one is bare.
  ferry::RuntimeArgs args;
  args.set("pool-bytes", "4MiB").set("chunk-bytes", "256KiB");
  auto made = ferry::Runtime::create(args);
  REQUIRE(made.ok());
  auto& rt = **made;
  REQUIRE(rt.options().root.empty());
  MatrixModel m(5);
  ferry::SavePlannerOptions o;
  o.save.compress = "zstd";
  o.save.shard_size = 1 << 18;
  ferry::SavePlanner p(rt, m.sd, d.path() + "/ckpt/my_checkpoint", o);
  auto path = run_steps(p);
  REQUIRE(path.ok());
  CHECK(*path == d.path() + "/ckpt/step-00000000");
  CHECK(data_files_in(*path).front() == "my_checkpoint-00000-0000.ferryz");
  MatrixModel back(12);
  REQUIRE(rt.load(back.sd, *path).ok());
  CHECK(back.big == m.big);

  // A bare name: the working directory.
  const auto cwd = fs::current_path();
  fs::current_path(d.path());
  ferry::SavePlanner bare(rt, m.sd, "my_checkpoint");
  auto here = run_steps(bare);
  fs::current_path(cwd);
  REQUIRE(here.ok());
  CHECK(*here == fs::path(d.path()).lexically_normal().string() + "/step-00000000");
  CHECK(data_files_in(*here) == std::vector<std::string>{"my_checkpoint-00000-0000.safetensors"});

  // Neither a root nor a prefix: the error says what to pass.
  ferry::SavePlanner none(rt, m.sd);
  CHECK_THAT(run_steps(none).status().message(), Catch::Contains("no checkpoint root"));
}
