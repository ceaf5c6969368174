#include "object_fs.hpp"

#include <algorithm>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <set>

#include "async_file.hpp"
#include "s3/client.hpp"

namespace ferry {
namespace {

// write_temp_file's names: such a file lives in memory until renamed.
bool is_temp_name(const std::string& path) {
  auto slash = path.rfind('/');
  return path.find(".tmp-", slash == std::string::npos ? 0 : slash) != std::string::npos;
}

Status unsupported(const std::string& what, const std::string& path) {
  return Status::unsupported(path + ": " + what + " is not offered on an object store");
}

// A data object: pieces gather into parts (a piece that is a whole part at a
// part boundary goes out as it is, without a copy, and its write ends when
// the part is stored); truncate(size) sends the rest and finishes the
// object, close() without it aborts the upload.
class ObjectFile : public File, public AsyncWriteFile {
 public:
  ObjectFile(std::string path, std::unique_ptr<ObjectWriter> w, uint64_t part)
      : path_(std::move(path)), w_(std::move(w)), part_(part) {}
  ~ObjectFile() override { (void)close(); }

  const std::string& path() const override { return path_; }
  bool direct() const override { return false; }

  Status pwrite(const void* data, size_t len, uint64_t offset) override {
    std::promise<Status> written;
    pwrite_async(data, len, offset, [&written](Status s) { written.set_value(std::move(s)); });
    return written.get_future().get();
  }

  void pwrite_async(const void* data, size_t len, uint64_t offset,
                    std::function<void(Status)> done) override {
    auto joined = std::make_shared<JoinedDone>(std::move(done));
    const char* p = static_cast<const char*>(data);
    while (len > 0) {
      const uint64_t index = offset / part_;
      const uint64_t at = offset - index * part_;
      const size_t n = static_cast<size_t>(std::min<uint64_t>(len, part_ - at));
      std::shared_ptr<std::string> full;
      const char* send = nullptr;
      {
        std::lock_guard<std::mutex> lock(mu_);
        Status refused;
        if (done_) refused = Status::invalid_argument(path_ + ": written after it was finished");
        if (sent_.count(index))
          refused = Status::invalid_argument(path_ + ": bytes at " + std::to_string(offset) +
                                             " rewrite a part already sent");
        if (!refused.ok()) {
          joined->end(std::move(refused));
          return;
        }
        auto it = parts_.find(index);
        if (at == 0 && n == part_ && it == parts_.end()) {
          sent_.insert(index);
          send = p;
        } else {
          Part& part = parts_[index];
          if (part.bytes.empty()) part.bytes.reserve(part_);
          if (part.bytes.size() < at + n) part.bytes.resize(at + n);
          std::memcpy(&part.bytes[at], p, n);
          part.filled += n;
          if (part.filled >= part_) {
            full = std::make_shared<std::string>(std::move(part.bytes));
            parts_.erase(index);
            sent_.insert(index);
            send = full->data();
          }
        }
      }
      // Sent outside the lock: other writers' parts go side by side. A
      // gathered part lives until it is stored.
      if (send) {
        joined->add();
        w_->write_async(index * part_, send, part_,
                        [joined, full](Status s) { joined->end(std::move(s)); });
      }
      offset += n;
      p += n;
      len -= n;
    }
    joined->end(Status());
  }

  Result<size_t> pread(void*, size_t, uint64_t) override {
    return unsupported("reading an object being written", path_);
  }

  // The end of the writes: the object is complete at `size` bytes.
  Status truncate(uint64_t size) override {
    std::map<uint64_t, Part> rest;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (done_) return Status::invalid_argument(path_ + ": finished twice");
      done_ = true;
      rest = std::move(parts_);
    }
    const uint64_t parts = (size + part_ - 1) / part_;
    for (auto& [index, part] : rest) {
      if (index >= parts) continue;  // padding past the end
      const uint64_t want = std::min(part_, size - index * part_);
      if (part.filled < want || part.bytes.size() < want) {
        (void)w_->abort();
        return Status::invalid_argument(path_ + ": finished at " + std::to_string(size) +
                                        " bytes but part " + std::to_string(index + 1) +
                                        " was not written whole");
      }
      Status s = w_->write(index * part_, part.bytes.data(), want);
      if (!s.ok()) {
        (void)w_->abort();
        return s;
      }
    }
    Status s = w_->finish(size);
    finished_ = s.ok();
    return s;
  }
  Status sync() override { return Status(); }  // durable at finish
  Status close() override {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    if (!finished_) (void)w_->abort();
    finished_ = true;
    return Status();
  }

 private:
  struct Part {
    std::string bytes;
    uint64_t filled = 0;
  };
  std::string path_;
  std::unique_ptr<ObjectWriter> w_;
  uint64_t part_;
  std::mutex mu_;
  std::map<uint64_t, Part> parts_;
  std::set<uint64_t> sent_;
  bool done_ = false;
  bool finished_ = false;
};

class ReadObject : public File {
 public:
  ReadObject(std::string path, std::shared_ptr<Store> store, std::string key)
      : path_(std::move(path)), store_(std::move(store)), key_(std::move(key)) {}
  const std::string& path() const override { return path_; }
  bool direct() const override { return false; }
  Status pwrite(const void*, size_t, uint64_t) override {
    return unsupported("writing an object opened for reading", path_);
  }
  Result<size_t> pread(void* data, size_t len, uint64_t offset) override {
    return store_->read(key_, offset, data, len);
  }
  Status truncate(uint64_t) override { return unsupported("truncate", path_); }
  Status sync() override { return Status(); }
  Status close() override { return Status(); }

 private:
  std::string path_;
  std::shared_ptr<Store> store_;
  std::string key_;
};

class StoreFilesystem;

// A temporary file: its bytes stay in memory, handed to the filesystem at close.
class TempObject : public File {
 public:
  TempObject(std::string path, StoreFilesystem& fs) : path_(std::move(path)), fs_(fs) {}
  ~TempObject() override { (void)close(); }
  const std::string& path() const override { return path_; }
  bool direct() const override { return false; }
  Status pwrite(const void* data, size_t len, uint64_t offset) override {
    if (closed_) return Status::invalid_argument(path_ + ": written after close");
    if (bytes_.size() < offset + len) bytes_.resize(offset + len);
    std::memcpy(&bytes_[offset], data, len);
    return Status();
  }
  Result<size_t> pread(void* data, size_t len, uint64_t offset) override {
    if (offset >= bytes_.size()) return size_t{0};
    size_t n = std::min<uint64_t>(len, bytes_.size() - offset);
    std::memcpy(data, &bytes_[offset], n);
    return n;
  }
  Status truncate(uint64_t size) override {
    bytes_.resize(size);
    return Status();
  }
  Status sync() override { return Status(); }
  Status close() override;

 private:
  std::string path_;
  StoreFilesystem& fs_;
  std::string bytes_;
  bool closed_ = false;
};

class NoLock : public FileLock {};

class StoreFilesystem : public Filesystem {
 public:
  explicit StoreFilesystem(std::shared_ptr<Store> store) : store_(std::move(store)) {}

  Result<std::unique_ptr<File>> open(const std::string& path, const OpenOptions& o) override {
    FERRY_ASSIGN_OR_RETURN(std::string key, key_of(path));
    if (key.empty()) return Status::invalid_argument(path + " is the store's root, not an object");
    if (o.write) {
      if (!o.create) return unsupported("rewriting an object", path);
      if (is_temp_name(path)) return std::unique_ptr<File>(new TempObject(path, *this));
      if (o.exclusive && store_->size(key).ok()) return Status::already_exists(path + " exists");
      FERRY_ASSIGN_OR_RETURN(std::unique_ptr<ObjectWriter> w, store_->create(key));
      return std::unique_ptr<File>(new ObjectFile(path, std::move(w), store_->part_bytes()));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = temps_.find(path);
      if (it != temps_.end()) {
        auto t = std::make_unique<TempObject>(path, *this);
        (void)t->pwrite(it->second.data(), it->second.size(), 0);
        return std::unique_ptr<File>(std::move(t));
      }
    }
    FERRY_RETURN_IF_ERROR(store_->size(key).status());
    return std::unique_ptr<File>(new ReadObject(path, store_, key));
  }

  Status mkdir(const std::string& path) override {
    Result<FileInfo> st = stat(path);
    if (st.ok()) return Status::already_exists(path + " exists");
    return st.status().code() == StatusCode::not_found ? Status() : st.status();
  }
  Status mkdirs(const std::string& path) override { return key_of(path).status(); }

  Status rename(const std::string& from, const std::string& to) override {
    return move_temp(from, to, /*if_absent=*/false);
  }
  Status rename_noreplace(const std::string& from, const std::string& to) override {
    return move_temp(from, to, /*if_absent=*/true);
  }

  Status unlink(const std::string& path) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (temps_.erase(path)) return Status();
    }
    FERRY_ASSIGN_OR_RETURN(std::string key, key_of(path));
    if (key.empty()) return Status::invalid_argument(path + " is the store's root");
    return store_->remove({key});
  }
  Status rmdir(const std::string& path) override { return key_of(path).status(); }
  Status sync_dir(const std::string& path) override { return key_of(path).status(); }

  Result<std::vector<std::string>> list(const std::string& dir) override {
    FERRY_ASSIGN_OR_RETURN(std::string key, key_of(dir));
    // A prefix with nothing under it is an empty one, not a missing one.
    return store_->children(key.empty() ? "" : key + "/");
  }

  Result<FileInfo> stat(const std::string& path) override {
    FERRY_ASSIGN_OR_RETURN(std::string key, key_of(path));
    FileInfo info;
    if (key.empty()) {
      info.is_dir = true;
      return info;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = temps_.find(path);
      if (it != temps_.end()) {
        info.is_regular = true;
        info.size = it->second.size();
        return info;
      }
    }
    Result<uint64_t> size = store_->size(key);
    if (size.ok()) {
      info.is_regular = true;
      info.size = *size;
      return info;
    }
    if (size.status().code() != StatusCode::not_found) return size.status();
    FERRY_ASSIGN_OR_RETURN(std::vector<std::string> under, store_->children(key + "/"));
    if (under.empty()) return Status::not_found(path + ": no such object or prefix");
    info.is_dir = true;
    return info;
  }
  Result<FileInfo> lstat(const std::string& path) override { return stat(path); }

  // An object store has no lock across processes: the commit rests on the
  // create-once MANIFEST instead (docs/format.md states what that leaves).
  Result<std::unique_ptr<FileLock>> lock(const std::string& path, int64_t) override {
    FERRY_RETURN_IF_ERROR(key_of(path).status());
    return std::unique_ptr<FileLock>(new NoLock);
  }

  Store& store() { return *store_; }
  // `path`'s key ("" for the root).
  Result<std::string> key(const std::string& path) const { return key_of(path); }

  void keep_temp(const std::string& path, std::string bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    temps_[path] = std::move(bytes);
  }

 private:
  // "" for the store's root itself.
  Result<std::string> key_of(const std::string& path) const {
    const std::string& root = store_->root();
    if (path == root || path == root + "/") return std::string();
    if (path.compare(0, root.size(), root) != 0 || path.size() <= root.size() + 1 ||
        path[root.size()] != '/')
      return Status::invalid_argument(path + " is not inside " + root);
    std::string key = path.substr(root.size() + 1);
    while (!key.empty() && key.back() == '/') key.pop_back();
    FERRY_RETURN_IF_ERROR(check_object_key(key).with_context(root + ": "));
    return key;
  }

  Status move_temp(const std::string& from, const std::string& to, bool if_absent) {
    std::string bytes;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = temps_.find(from);
      if (it == temps_.end())
        return unsupported("renaming (only a file just written may be put in place)", from);
      bytes = it->second;
    }
    FERRY_ASSIGN_OR_RETURN(std::string key, key_of(to));
    Status s = if_absent ? store_->put_if_absent(key, bytes) : store_->put(key, bytes);
    if (s.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      temps_.erase(from);
    }
    return s;
  }

  std::shared_ptr<Store> store_;
  std::mutex mu_;
  std::map<std::string, std::string> temps_;  // path -> bytes, until renamed or unlinked
};

Status TempObject::close() {
  if (closed_) return Status();
  closed_ = true;
  fs_.keep_temp(path_, std::move(bytes_));
  return Status();
}

class ObjectRootFilesystem : public FilesystemWrapper {
 public:
  ObjectRootFilesystem(std::shared_ptr<Filesystem> base, std::function<S3StoreOptions()> options)
      : FilesystemWrapper(std::move(base)), options_(std::move(options)) {}

  Result<std::unique_ptr<File>> open(const std::string& p, const OpenOptions& o) override {
    FERRY_ASSIGN_OR_RETURN(Filesystem * fs, route(p));
    return fs->open(p, o);
  }
  Status mkdir(const std::string& p) override {
    FERRY_ASSIGN_OR_RETURN(Filesystem * fs, route(p));
    return fs->mkdir(p);
  }
  Status mkdirs(const std::string& p) override {
    FERRY_ASSIGN_OR_RETURN(Filesystem * fs, route(p));
    return fs->mkdirs(p);
  }
  Status rename(const std::string& f, const std::string& t) override {
    FERRY_ASSIGN_OR_RETURN(Filesystem * fs, route_pair(f, t));
    return fs->rename(f, t);
  }
  Status rename_noreplace(const std::string& f, const std::string& t) override {
    FERRY_ASSIGN_OR_RETURN(Filesystem * fs, route_pair(f, t));
    return fs->rename_noreplace(f, t);
  }
  Status unlink(const std::string& p) override {
    FERRY_ASSIGN_OR_RETURN(Filesystem * fs, route(p));
    return fs->unlink(p);
  }
  Status rmdir(const std::string& p) override {
    FERRY_ASSIGN_OR_RETURN(Filesystem * fs, route(p));
    return fs->rmdir(p);
  }
  Status sync_dir(const std::string& p) override {
    FERRY_ASSIGN_OR_RETURN(Filesystem * fs, route(p));
    return fs->sync_dir(p);
  }
  Result<std::vector<std::string>> list(const std::string& d) override {
    FERRY_ASSIGN_OR_RETURN(Filesystem * fs, route(d));
    return fs->list(d);
  }
  Result<FileInfo> stat(const std::string& p) override {
    FERRY_ASSIGN_OR_RETURN(Filesystem * fs, route(p));
    return fs->stat(p);
  }
  Result<FileInfo> lstat(const std::string& p) override {
    FERRY_ASSIGN_OR_RETURN(Filesystem * fs, route(p));
    return fs->lstat(p);
  }
  Result<std::unique_ptr<FileLock>> lock(const std::string& p, int64_t wait_ms) override {
    FERRY_ASSIGN_OR_RETURN(Filesystem * fs, route(p));
    return fs->lock(p, wait_ms);
  }
  void add_root(const std::string& root) override {
    if (!is_object_root(root)) target_->add_root(root);
  }
  void release_root(const std::string& root) override {
    if (!is_object_root(root)) target_->release_root(root);
  }

  // The store under an object path, and the path's key in it.
  Result<std::pair<StoreFilesystem*, std::string>> store_of(const std::string& path) {
    if (!is_object_root(path)) return Status::invalid_argument(path + " is no object root");
    FERRY_ASSIGN_OR_RETURN(Filesystem * fs, route(path));
    auto* sfs = static_cast<StoreFilesystem*>(fs);
    FERRY_ASSIGN_OR_RETURN(std::string key, sfs->key(path));
    return std::make_pair(sfs, key);
  }

 private:
  Result<Filesystem*> route(const std::string& path) {
    if (!is_object_root(path)) return target_.get();
    FERRY_ASSIGN_OR_RETURN(s3::Url url, s3::parse_url(path));
    std::lock_guard<std::mutex> lock(mu_);
    auto it = buckets_.find(url.bucket);
    if (it != buckets_.end()) return it->second.get();
    FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Store> store,
                           s3_store("s3://" + url.bucket, options_()));
    auto fs = store_filesystem(std::move(store));
    Filesystem* raw = fs.get();
    buckets_.emplace(url.bucket, std::move(fs));
    return raw;
  }
  Result<Filesystem*> route_pair(const std::string& from, const std::string& to) {
    FERRY_ASSIGN_OR_RETURN(Filesystem * a, route(from));
    FERRY_ASSIGN_OR_RETURN(Filesystem * b, route(to));
    if (a != b) return Status::unsupported("renaming " + from + " to " + to + " across stores");
    return a;
  }

  std::function<S3StoreOptions()> options_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<Filesystem>> buckets_;
};

}  // namespace

bool is_object_root(const std::string& path) {
  return s3::is_s3_url(path);
}

S3StoreOptions s3_store_options(const Options& o) {
  S3StoreOptions s;
  s.client.endpoint = o.s3_endpoint;
  if (!o.s3_region.empty()) s.client.region = o.s3_region;
  s.client.virtual_addressing = o.s3_virtual_addressing;
  s3::config_from_environment(&s.client);
  if (!o.s3_region.empty()) s.client.region = o.s3_region;  // the setting beats AWS_REGION
  const uint64_t block = std::max<uint64_t>(o.chunk_bytes, 1);
  s.part_bytes = std::max<uint64_t>(block, ((8ull << 20) + block - 1) / block * block);
  // No request outlasts the phase it serves (a stalled response included):
  // data by write-timeout, the rest by commit-timeout; an attempt gets a
  // quarter of the write phase, so a stalled one is retried within it.
  const int64_t write_ms = static_cast<int64_t>(o.write_timeout_s * 1000);
  const int64_t commit_ms = static_cast<int64_t>(o.commit_timeout_s * 1000);
  if (write_ms > 0) {
    s.data_timeout_ms = std::min(s.data_timeout_ms, write_ms);
    s.client.attempt_timeout_ms =
        std::min(s.client.attempt_timeout_ms, std::max<int64_t>(1000, write_ms / 4));
  }
  if (commit_ms > 0) s.op_timeout_ms = std::min(s.op_timeout_ms, commit_ms);
  s.parts_in_flight = static_cast<int>(std::max<uint32_t>(1, o.s3_parts_in_flight));
  // Room for every part in flight and for the reads and small requests beside them.
  s.client.connections = std::max(s.client.connections, s.parts_in_flight + 4);
  return s;
}

Result<std::vector<PendingUpload>> unfinished_uploads(Filesystem& fs, const std::string& path) {
  auto* router = dynamic_cast<ObjectRootFilesystem*>(&fs);
  if (!router || !is_object_root(path)) return std::vector<PendingUpload>{};
  FERRY_ASSIGN_OR_RETURN(auto at, router->store_of(path));
  return at.first->store().uploads(at.second.empty() ? "" : at.second + "/");
}

Status abort_unfinished_upload(Filesystem& fs, const std::string& path, const PendingUpload& u) {
  auto* router = dynamic_cast<ObjectRootFilesystem*>(&fs);
  if (!router) return Status::unsupported(path + ": no object store to abort " + u.key + " in");
  FERRY_ASSIGN_OR_RETURN(auto at, router->store_of(path));
  return at.first->store().abort_upload(u);
}

std::shared_ptr<Filesystem> store_filesystem(std::shared_ptr<Store> store) {
  return std::make_shared<StoreFilesystem>(std::move(store));
}

std::shared_ptr<Filesystem> with_object_roots(std::shared_ptr<Filesystem> base,
                                              std::function<S3StoreOptions()> s3_options) {
  return std::make_shared<ObjectRootFilesystem>(std::move(base), std::move(s3_options));
}

}  // namespace ferry
