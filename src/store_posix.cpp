// The directory store: one file per object, written under a temporary name
// beside its key and renamed into place when finished.
#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>

#include <unistd.h>

#include "store.hpp"

namespace ferry {
namespace {

// Temporary names carry this marker: listings skip them, and no key may
// contain it, so an object never looks like someone's unfinished write.
constexpr const char* kTempMarker = ".ferry-tmp-";

std::string temp_name(const std::string& path) {
  static std::atomic<uint64_t> n{0};
  return path + kTempMarker + std::to_string(getpid()) + "-" + std::to_string(n++);
}

class DirectoryWriter : public ObjectWriter {
 public:
  DirectoryWriter(Filesystem& fs, std::string path, std::string temp, std::unique_ptr<File> file)
      : fs_(fs), path_(std::move(path)), temp_(std::move(temp)), file_(std::move(file)) {}
  ~DirectoryWriter() override { (void)abort(); }

  Status write(uint64_t offset, const void* data, size_t len) override {
    if (done_) return Status::invalid_argument(path_ + ": written after finish or abort");
    Status s = file_->pwrite(data, len, offset);
    if (s.ok() && len > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      pieces_[offset] = std::max<uint64_t>(pieces_[offset], len);
    }
    return s;
  }

  Status finish(uint64_t size) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return Status::invalid_argument(path_ + ": finished twice or after abort");
    auto info = fs_.stat(temp_);
    if (!info.ok()) return info.status();
    // Every byte written, as S3's parts must be: a hole is a piece lost.
    uint64_t covered = 0;
    for (const auto& [off, len] : pieces_) {
      if (off > covered) break;
      covered = std::max(covered, off + len);
    }
    if (info.value().size != size || covered < size)
      return Status::invalid_argument(
          path_ + ": finished at " + std::to_string(size) + " bytes but only the first " +
          std::to_string(std::min(covered, info.value().size)) + " were written");
    Status s = file_->sync();
    if (s.ok()) s = file_->close();
    if (s.ok()) s = fs_.rename(temp_, path_);
    if (s.ok()) s = fs_.sync_dir(parent_path(path_));
    if (!s.ok()) {
      (void)fs_.unlink(temp_);
      done_ = true;
      return s;
    }
    done_ = true;
    return Status();
  }

  Status abort() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return Status();
    done_ = true;
    (void)file_->close();
    Status s = fs_.unlink(temp_);
    return s.code() == StatusCode::not_found ? Status() : s;
  }

 private:
  Filesystem& fs_;
  std::string path_;
  std::string temp_;
  std::unique_ptr<File> file_;
  std::mutex mu_;
  std::map<uint64_t, uint64_t> pieces_;  // offset -> length
  std::atomic<bool> done_{false};
};

class DirectoryStore : public Store {
 public:
  // Nothing below the store's directory is followed if it is a link.
  DirectoryStore(std::shared_ptr<Filesystem> fs, std::string dir)
      : fs_(std::move(fs)), dir_(std::move(dir)), hold_(fs_, dir_) {}

  const std::string& root() const override { return dir_; }
  uint64_t part_bytes() const override { return 1; }

  Result<std::unique_ptr<ObjectWriter>> create(const std::string& key) override {
    auto path = path_of(key);
    if (!path.ok()) return path.status();
    Status s = make_parents(key);
    if (!s.ok()) return s;
    std::string temp = temp_name(path.value());
    OpenOptions o;
    o.write = o.create = o.exclusive = true;
    auto file = fs_->open(temp, o);
    if (!file.ok()) return file.status();
    return std::unique_ptr<ObjectWriter>(
        new DirectoryWriter(*fs_, path.value(), temp, std::move(file).value()));
  }

  Result<size_t> read(const std::string& key, uint64_t offset, void* out, size_t len) override {
    auto path = path_of(key);
    if (!path.ok()) return path.status();
    auto file = fs_->open(path.value(), OpenOptions{});
    if (!file.ok()) return file.status();
    return file.value()->pread(out, len, offset);
  }

  Result<std::string> read_all(const std::string& key, uint64_t max_bytes) override {
    auto path = path_of(key);
    if (!path.ok()) return path.status();
    return read_file(*fs_, path.value(), max_bytes);
  }

  Result<uint64_t> size(const std::string& key) override {
    auto path = path_of(key);
    if (!path.ok()) return path.status();
    auto info = fs_->lstat(path.value());
    if (!info.ok()) return info.status();
    if (!info.value().is_regular) return Status::not_found(path.value() + " is not a regular file");
    return info.value().size;
  }

  Result<std::vector<ObjectEntry>> list(const std::string& prefix) override {
    // Walk from the deepest directory the prefix names, then filter.
    auto slash = prefix.rfind('/');
    std::string base = slash == std::string::npos ? "" : prefix.substr(0, slash);
    std::vector<ObjectEntry> out;
    Status s = walk(base, prefix, &out);
    if (!s.ok()) return s;
    std::sort(out.begin(), out.end(),
              [](const ObjectEntry& a, const ObjectEntry& b) { return a.key < b.key; });
    return out;
  }

  Status put(const std::string& key, const std::string& bytes) override {
    auto path = path_of(key);
    if (!path.ok()) return path.status();
    Status s = make_parents(key);
    if (!s.ok()) return s;
    return write_file_atomic(*fs_, path.value(), bytes, true);
  }

  Status put_if_absent(const std::string& key, const std::string& bytes) override {
    auto path = path_of(key);
    if (!path.ok()) return path.status();
    Status s = make_parents(key);
    if (!s.ok()) return s;
    auto temp = write_temp_file(*fs_, path.value(), bytes, true);
    if (!temp.ok()) return temp.status();
    s = fs_->rename_noreplace(temp.value(), path.value());
    if (!s.ok()) {
      (void)fs_->unlink(temp.value());
      return s.code() == StatusCode::already_exists
                 ? Status::already_exists(path.value() + " exists: created by another writer")
                 : s;
    }
    return fs_->sync_dir(parent_path(path.value()));
  }

  Status remove(const std::vector<std::string>& keys) override {
    for (const auto& key : keys) {
      auto path = path_of(key);
      if (!path.ok()) return path.status();
      Status s = fs_->unlink(path.value());
      if (!s.ok() && s.code() != StatusCode::not_found) return s;
    }
    return Status();
  }

 private:
  Result<std::string> path_of(const std::string& key) const {
    Status s = check_object_key(key);
    if (!s.ok()) return s.with_context(dir_ + ": ");
    if (key.find(kTempMarker) != std::string::npos)
      return Status::invalid_argument(dir_ + ": key '" + key + "' contains " + kTempMarker);
    return join_path(dir_, key);
  }

  // Each directory made on the way to a key is synced into its parent, so a
  // power cut that keeps an object keeps the path to it.
  Status make_parents(const std::string& key) {
    for (size_t slash = key.find('/'); slash != std::string::npos;
         slash = key.find('/', slash + 1)) {
      std::string d = join_path(dir_, key.substr(0, slash));
      Status s = fs_->mkdir(d);
      if (s.ok()) s = fs_->sync_dir(parent_path(d));
      if (!s.ok() && s.code() != StatusCode::already_exists) return s;
    }
    return Status();
  }

  // Regular files only: links and anything else are not objects of ours.
  Status walk(const std::string& rel, const std::string& prefix, std::vector<ObjectEntry>* out) {
    std::string path = rel.empty() ? dir_ : join_path(dir_, rel);
    auto names = fs_->list(path);
    if (!names.ok())
      return names.status().code() == StatusCode::not_found ? Status() : names.status();
    for (const auto& name : names.value()) {
      if (name.find(kTempMarker) != std::string::npos) continue;
      std::string key = rel.empty() ? name : rel + "/" + name;
      // Only what can still lead to the prefix, or lies under it.
      if (key.compare(0, std::min(key.size(), prefix.size()), prefix, 0,
                      std::min(key.size(), prefix.size())) != 0)
        continue;
      auto info = fs_->lstat(join_path(dir_, key));
      if (!info.ok()) {
        if (info.status().code() == StatusCode::not_found) continue;  // removed meanwhile
        return info.status();
      }
      if (info.value().is_dir) {
        Status s = walk(key, prefix, out);
        if (!s.ok()) return s;
      } else if (info.value().is_regular && key.size() >= prefix.size()) {
        out->push_back({key, info.value().size});
      }
    }
    return Status();
  }

  std::shared_ptr<Filesystem> fs_;
  std::string dir_;
  RootHold hold_;
};

}  // namespace

Status check_object_key(const std::string& key) {
  if (key.empty()) return Status::invalid_argument("an empty object key");
  if (key.front() == '/') return Status::invalid_argument("object key '" + key + "' starts with /");
  size_t start = 0;
  while (start <= key.size()) {
    size_t end = key.find('/', start);
    if (end == std::string::npos) end = key.size();
    std::string part = key.substr(start, end - start);
    if (part.empty() || part == "." || part == "..")
      return Status::invalid_argument("object key '" + key + "' has an empty, '.' or '..' part");
    start = end + 1;
  }
  for (unsigned char c : key)
    if (c < 0x20 || c == 0x7f)
      return Status::invalid_argument("object key '" + key + "' has a control character");
  return Status();
}

Result<std::shared_ptr<Store>> directory_store(std::shared_ptr<Filesystem> fs,
                                               const std::string& dir) {
  if (dir.empty()) return Status::invalid_argument("directory store: empty path");
  if (!fs->stat(dir).ok()) {
    // Made here: synced into its parent, as the directories below it are.
    Status s = fs->mkdirs(dir);
    if (s.ok()) s = fs->sync_dir(parent_path(dir));
    if (!s.ok()) return s;
  }
  return std::shared_ptr<Store>(new DirectoryStore(std::move(fs), dir));
}

}  // namespace ferry
