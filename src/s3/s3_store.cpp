#include "s3/s3_store.hpp"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <ctime>
#include <map>
#include <mutex>

namespace ferry {
namespace {

// "2026-12-06T17:38:23.000Z" -> unix ms; 0 (the oldest) when it does not parse.
int64_t iso8601_unix_ms(const std::string& t) {
  std::tm tm{};
  const char* rest = strptime(t.c_str(), "%Y-%m-%dT%H:%M:%S", &tm);
  if (!rest) return 0;
  int64_t ms = static_cast<int64_t>(timegm(&tm)) * 1000;
  if (*rest == '.') ms += std::strtol(rest + 1, nullptr, 10) % 1000;
  return ms;
}

class S3Writer : public ObjectWriter {
 public:
  S3Writer(s3::Client& c, std::string bucket, std::string key, uint64_t part, int64_t timeout_ms)
      : c_(c),
        bucket_(std::move(bucket)),
        key_(std::move(key)),
        part_(part),
        timeout_ms_(timeout_ms) {}
  ~S3Writer() override { (void)abort(); }

  Status write(uint64_t offset, const void* data, size_t len) override {
    if (done_) return Status::invalid_argument(name() + ": written after finish or abort");
    if (offset % part_ != 0)
      return Status::invalid_argument(name() + ": a piece at offset " + std::to_string(offset) +
                                      " is not on a part boundary (" + std::to_string(part_) +
                                      " bytes)");
    const char* p = static_cast<const char*>(data);
    // A piece larger than a part goes as several parts.
    while (len > 0) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(len, part_));
      Status s = send_part(offset, p, n);
      if (!s.ok()) return s;
      offset += n;
      p += n;
      len -= n;
    }
    return Status();
  }

  Status finish(uint64_t size) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (done_) return Status::invalid_argument(name() + ": finished twice or after abort");
    done_ = true;
    auto d = deadline();
    if (upload_id_.empty()) {
      // Nothing written, or one small piece: a single PUT.
      if (size != single_.size())
        return Status::invalid_argument(name() + ": finished at " + std::to_string(size) +
                                        " bytes but " + std::to_string(single_.size()) +
                                        " were written");
      return c_.put(bucket_, key_, single_.data(), single_.size(), {}, d);
    }
    uint64_t parts = (size + part_ - 1) / part_;
    std::vector<std::string> etags;
    for (uint64_t i = 1; i <= parts; ++i) {
      auto it = etags_.find(static_cast<int>(i));
      uint64_t want = std::min(part_, size - (i - 1) * part_);
      if (it == etags_.end() || sizes_[static_cast<int>(i)] != want) {
        Status s = Status::invalid_argument(name() + ": finished at " + std::to_string(size) +
                                            " bytes but part " + std::to_string(i) +
                                            " was not written whole");
        (void)c_.abort_multipart(bucket_, key_, upload_id_, d);
        return s;
      }
      etags.push_back(it->second);
    }
    if (etags_.size() != parts) {
      (void)c_.abort_multipart(bucket_, key_, upload_id_, d);
      return Status::invalid_argument(name() + ": bytes written past the finished size " +
                                      std::to_string(size));
    }
    Status s = c_.complete_multipart(bucket_, key_, upload_id_, etags, d);
    if (!s.ok()) (void)c_.abort_multipart(bucket_, key_, upload_id_, d);
    return s;
  }

  Status abort() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return Status();
    done_ = true;
    if (upload_id_.empty()) return Status();
    return c_.abort_multipart(bucket_, key_, upload_id_, deadline());
  }

 private:
  std::string name() const { return "s3://" + bucket_ + "/" + key_; }
  s3::Deadline deadline() const { return s3::Deadline::in(std::chrono::milliseconds(timeout_ms_)); }

  Status send_part(uint64_t offset, const char* p, size_t n) {
    std::string id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // A short first piece at offset 0 may be the whole object: kept for a
      // single PUT unless more parts follow.
      if (upload_id_.empty() && offset == 0 && n < part_ && single_.empty() && etags_.empty()) {
        single_.assign(p, n);
        return Status();
      }
      if (upload_id_.empty()) {
        auto made = c_.create_multipart(bucket_, key_, deadline());
        if (!made.ok()) return made.status();
        upload_id_ = made.value();
        if (!single_.empty()) {
          // The short piece was not the whole object after all.
          return Status::invalid_argument(name() + ": a piece of " +
                                          std::to_string(single_.size()) +
                                          " bytes at offset 0 is shorter than a part (" +
                                          std::to_string(part_) + ") but more pieces follow");
        }
      }
      id = upload_id_;
    }
    int number = static_cast<int>(offset / part_) + 1;
    auto etag = c_.upload_part(bucket_, key_, id, number, p, n, deadline());
    if (!etag.ok()) return etag.status();
    std::lock_guard<std::mutex> lock(mu_);
    etags_[number] = etag.value();
    sizes_[number] = n;
    return Status();
  }

  s3::Client& c_;
  std::string bucket_;
  std::string key_;
  uint64_t part_;
  int64_t timeout_ms_;
  std::mutex mu_;
  std::atomic<bool> done_{false};
  std::string upload_id_;
  std::string single_;
  std::map<int, std::string> etags_;
  std::map<int, uint64_t> sizes_;
};

class S3Store : public Store {
 public:
  S3Store(std::unique_ptr<s3::Client> c, s3::Url url, std::string root, S3StoreOptions o)
      : c_(std::move(c)), url_(std::move(url)), root_(std::move(root)), o_(std::move(o)) {}

  const std::string& root() const override { return root_; }
  uint64_t part_bytes() const override { return o_.part_bytes; }

  Result<std::unique_ptr<ObjectWriter>> create(const std::string& key) override {
    auto k = key_of(key);
    if (!k.ok()) return k.status();
    return std::unique_ptr<ObjectWriter>(
        new S3Writer(*c_, url_.bucket, k.value(), o_.part_bytes, o_.data_timeout_ms));
  }

  Result<size_t> read(const std::string& key, uint64_t offset, void* out, size_t len) override {
    auto k = key_of(key);
    if (!k.ok()) return k.status();
    return c_->get(url_.bucket, k.value(), offset, out, len,
                   s3::Deadline::in(std::chrono::milliseconds(o_.data_timeout_ms)));
  }

  Result<std::string> read_all(const std::string& key, uint64_t max_bytes) override {
    auto k = key_of(key);
    if (!k.ok()) return k.status();
    return c_->get_all(url_.bucket, k.value(), max_bytes, deadline());
  }

  Result<uint64_t> size(const std::string& key) override {
    auto k = key_of(key);
    if (!k.ok()) return k.status();
    auto info = c_->head(url_.bucket, k.value(), deadline());
    if (!info.ok()) return info.status();
    return info.value().size;
  }

  Result<std::vector<ObjectEntry>> list(const std::string& prefix) override {
    auto listed = c_->list(url_.bucket, full(prefix), deadline());
    if (!listed.ok()) return listed.status();
    std::vector<ObjectEntry> out;
    size_t strip = url_.prefix.empty() ? 0 : url_.prefix.size() + 1;
    for (auto& o : listed.value()) out.push_back({o.key.substr(strip), o.size});
    return out;
  }

  Result<std::vector<std::string>> children(const std::string& prefix) override {
    auto listed = c_->list(url_.bucket, full(prefix), deadline(), "/");
    if (!listed.ok()) return listed.status();
    std::vector<std::string> out;
    const size_t strip = full(prefix).size();
    for (auto& o : listed.value()) {
      std::string name = o.key.substr(std::min(strip, o.key.size()));
      if (!name.empty() && name.back() == '/') name.pop_back();
      if (!name.empty() && name.find('/') == std::string::npos) out.push_back(std::move(name));
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
  }

  Status put(const std::string& key, const std::string& bytes) override {
    auto k = key_of(key);
    if (!k.ok()) return k.status();
    return c_->put(url_.bucket, k.value(), bytes.data(), bytes.size(), {}, deadline());
  }

  Status put_if_absent(const std::string& key, const std::string& bytes) override {
    auto k = key_of(key);
    if (!k.ok()) return k.status();
    s3::PutOptions o;
    o.if_absent = true;
    return c_->put(url_.bucket, k.value(), bytes.data(), bytes.size(), o, deadline());
  }

  Status remove(const std::vector<std::string>& keys) override {
    std::vector<std::string> full_keys;
    for (const auto& key : keys) {
      auto k = key_of(key);
      if (!k.ok()) return k.status();
      full_keys.push_back(k.value());
    }
    return c_->remove(url_.bucket, full_keys, deadline());
  }

  Result<std::vector<PendingUpload>> uploads(const std::string& prefix) override {
    auto listed = c_->list_multipart(url_.bucket, full(prefix), deadline());
    if (!listed.ok()) return listed.status();
    std::vector<PendingUpload> out;
    size_t strip = url_.prefix.empty() ? 0 : url_.prefix.size() + 1;
    for (auto& u : listed.value())
      out.push_back({u.key.substr(strip), u.upload_id, iso8601_unix_ms(u.initiated)});
    return out;
  }

  Status abort_upload(const PendingUpload& u) override {
    auto k = key_of(u.key);
    if (!k.ok()) return k.status();
    return c_->abort_multipart(url_.bucket, k.value(), u.id, deadline());
  }

 private:
  std::string full(const std::string& key) const {
    return url_.prefix.empty() ? key : url_.prefix + "/" + key;
  }
  Result<std::string> key_of(const std::string& key) const {
    Status s = check_object_key(key);
    if (!s.ok()) return s.with_context(root_ + ": ");
    return full(key);
  }
  s3::Deadline deadline() const {
    return s3::Deadline::in(std::chrono::milliseconds(o_.op_timeout_ms));
  }

  std::unique_ptr<s3::Client> c_;
  s3::Url url_;
  std::string root_;
  S3StoreOptions o_;
};

}  // namespace

Result<std::shared_ptr<Store>> s3_store(const std::string& url, const S3StoreOptions& o) {
  auto u = s3::parse_url(url);
  if (!u.ok()) return u.status();
  if (o.part_bytes < (5ull << 20) || o.part_bytes > (5ull << 30))
    return Status::invalid_argument(url + ": S3 part size " + std::to_string(o.part_bytes) +
                                    " is outside S3's 5 MiB .. 5 GiB");
  auto c = s3::Client::create(o.client);
  if (!c.ok()) return c.status();
  std::string root =
      "s3://" + u.value().bucket + (u.value().prefix.empty() ? "" : "/" + u.value().prefix);
  return std::shared_ptr<Store>(new S3Store(std::move(c).value(), u.value(), root, o));
}

}  // namespace ferry
