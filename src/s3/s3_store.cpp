#include "s3/s3_store.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <ctime>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "async_file.hpp"

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

// The threads that send a store's parts: at most `limit` parts in flight,
// a caller beyond that waits for room (which bounds the connections and the
// staging blocks that parts hold). Started as parts come; the threads share
// their state, so one whose job drops the last reference to this ends well.
class Senders {
 public:
  explicit Senders(int limit) : st_(std::make_shared<State>()) { st_->limit = std::max(1, limit); }
  ~Senders() {
    std::vector<std::thread> threads;
    {
      std::lock_guard<std::mutex> lock(st_->mu);
      st_->stop = true;
      threads.swap(st_->threads);
    }
    st_->work.notify_all();
    for (auto& t : threads) {
      if (t.get_id() == std::this_thread::get_id())
        t.detach();
      else
        t.join();
    }
  }
  Senders(const Senders&) = delete;
  Senders& operator=(const Senders&) = delete;

  void run(std::function<void()> job) {
    std::unique_lock<std::mutex> lock(st_->mu);
    st_->room.wait(lock, [&] { return st_->pending < st_->limit; });
    ++st_->pending;
    st_->queue.push_back(std::move(job));
    if (st_->queue.size() > st_->idle && st_->threads.size() < static_cast<size_t>(st_->limit)) {
      try {
        st_->threads.emplace_back([st = st_] { loop(*st); });
      } catch (const std::system_error&) {
        if (st_->threads.empty()) {
          // No thread to be had: the caller sends it.
          std::function<void()> mine = std::move(st_->queue.back());
          st_->queue.pop_back();
          lock.unlock();
          mine();
          lock.lock();
          --st_->pending;
          st_->room.notify_one();
          return;
        }
      }
    }
    st_->work.notify_one();
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable work, room;
    std::deque<std::function<void()>> queue;
    std::vector<std::thread> threads;
    size_t idle = 0;
    int pending = 0;  // queued or running
    int limit = 1;
    bool stop = false;
  };
  static void loop(State& st) {
    std::unique_lock<std::mutex> lock(st.mu);
    for (;;) {
      ++st.idle;
      st.work.wait(lock, [&] { return st.stop || !st.queue.empty(); });
      --st.idle;
      if (st.queue.empty()) return;
      {
        std::function<void()> job = std::move(st.queue.front());
        st.queue.pop_front();
        lock.unlock();
        job();
      }  // what the job held goes before the lock is taken again
      lock.lock();
      --st.pending;
      st.room.notify_one();
    }
  }
  std::shared_ptr<State> st_;
};

class S3Writer : public ObjectWriter {
 public:
  S3Writer(std::shared_ptr<s3::Client> c, std::shared_ptr<Senders> senders, std::string bucket,
           std::string key, uint64_t part, int64_t timeout_ms)
      : c_(std::move(c)),
        senders_(std::move(senders)),
        bucket_(std::move(bucket)),
        key_(std::move(key)),
        part_(part),
        timeout_ms_(timeout_ms) {}
  ~S3Writer() override { (void)abort(); }

  Status write(uint64_t offset, const void* data, size_t len) override {
    std::promise<Status> sent;
    write_async(offset, data, len, [&sent](Status s) { sent.set_value(std::move(s)); });
    return sent.get_future().get();
  }

  void write_async(uint64_t offset, const void* data, size_t len,
                   std::function<void(Status)> done) override {
    if (done_) return done(Status::invalid_argument(name() + ": written after finish or abort"));
    if (offset % part_ != 0)
      return done(Status::invalid_argument(name() + ": a piece at offset " +
                                           std::to_string(offset) + " is not on a part boundary (" +
                                           std::to_string(part_) + " bytes)"));
    const char* p = static_cast<const char*>(data);
    if (len <= part_) return send_part(offset, p, len, std::move(done));
    // A piece larger than a part goes as several parts.
    auto joined = std::make_shared<JoinedDone>(std::move(done));
    while (len > 0) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(len, part_));
      joined->add();
      send_part(offset, p, n, [joined](Status s) { joined->end(std::move(s)); });
      offset += n;
      p += n;
      len -= n;
    }
    joined->end(Status());
  }

  Status finish(uint64_t size) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (done_) return Status::invalid_argument(name() + ": finished twice or after abort");
    done_ = true;
    landed_.wait(lock, [&] { return in_flight_ == 0; });
    auto d = deadline();
    if (!failed_.ok()) {
      if (!upload_id_.empty()) (void)c_->abort_multipart(bucket_, key_, upload_id_, d);
      return failed_;
    }
    if (upload_id_.empty()) {
      // Nothing written, or one small piece: a single PUT.
      if (size != single_.size())
        return Status::invalid_argument(name() + ": finished at " + std::to_string(size) +
                                        " bytes but " + std::to_string(single_.size()) +
                                        " were written");
      return c_->put(bucket_, key_, single_.data(), single_.size(), {}, d);
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
        (void)c_->abort_multipart(bucket_, key_, upload_id_, d);
        return s;
      }
      etags.push_back(it->second);
    }
    if (etags_.size() != parts) {
      (void)c_->abort_multipart(bucket_, key_, upload_id_, d);
      return Status::invalid_argument(name() + ": bytes written past the finished size " +
                                      std::to_string(size));
    }
    Status s = c_->complete_multipart(bucket_, key_, upload_id_, etags, d);
    if (!s.ok()) (void)c_->abort_multipart(bucket_, key_, upload_id_, d);
    return s;
  }

  // Waits for the parts in flight, so none lands after the upload is gone.
  Status abort() override {
    std::unique_lock<std::mutex> lock(mu_);
    if (aborted_) return Status();
    const bool finished = done_;
    done_ = true;
    landed_.wait(lock, [&] { return in_flight_ == 0; });
    aborted_ = true;
    if (finished || upload_id_.empty()) return Status();
    return c_->abort_multipart(bucket_, key_, upload_id_, deadline());
  }

 private:
  std::string name() const { return "s3://" + bucket_ + "/" + key_; }
  s3::Deadline deadline() const { return s3::Deadline::in(std::chrono::milliseconds(timeout_ms_)); }

  void send_part(uint64_t offset, const char* p, size_t n, std::function<void(Status)> done) {
    std::string id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // After a part failed the upload is lost: the rest fail at once.
      if (!failed_.ok()) return done(failed_);
      // A short first piece at offset 0 may be the whole object: kept for a
      // single PUT unless more parts follow.
      if (upload_id_.empty() && offset == 0 && n < part_ && single_.empty() && etags_.empty()) {
        single_.assign(p, n);
        return done(Status());
      }
      if (upload_id_.empty()) {
        auto made = c_->create_multipart(bucket_, key_, deadline());
        if (!made.ok()) {
          failed_ = made.status();
          return done(failed_);
        }
        upload_id_ = made.value();
        if (!single_.empty()) {
          // The short piece was not the whole object after all.
          return done(Status::invalid_argument(name() + ": a piece of " +
                                               std::to_string(single_.size()) +
                                               " bytes at offset 0 is shorter than a part (" +
                                               std::to_string(part_) + ") but more pieces follow"));
        }
      }
      id = upload_id_;
      ++in_flight_;
    }
    const int number = static_cast<int>(offset / part_) + 1;
    senders_->run([this, id, number, p, n, done = std::move(done)] {
      auto etag = c_->upload_part(bucket_, key_, id, number, p, n, deadline());
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (etag.ok()) {
          etags_[number] = etag.value();
          sizes_[number] = n;
        } else if (failed_.ok()) {
          failed_ = etag.status();
        }
      }
      done(etag.status());
      // Last: a finish or abort waiting for this may end the writer at once.
      std::lock_guard<std::mutex> lock(mu_);
      --in_flight_;
      landed_.notify_all();
    });
  }

  std::shared_ptr<s3::Client> c_;
  std::shared_ptr<Senders> senders_;
  std::string bucket_;
  std::string key_;
  uint64_t part_;
  int64_t timeout_ms_;
  std::mutex mu_;
  std::condition_variable landed_;
  int in_flight_ = 0;
  Status failed_;  // the first part that failed
  std::atomic<bool> done_{false};
  bool aborted_ = false;
  std::string upload_id_;
  std::string single_;
  std::map<int, std::string> etags_;
  std::map<int, uint64_t> sizes_;
};

class S3Store : public Store {
 public:
  S3Store(std::unique_ptr<s3::Client> c, s3::Url url, std::string root, S3StoreOptions o)
      : c_(std::move(c)),
        senders_(std::make_shared<Senders>(o.parts_in_flight)),
        url_(std::move(url)),
        root_(std::move(root)),
        o_(std::move(o)) {}

  const std::string& root() const override { return root_; }
  uint64_t part_bytes() const override { return o_.part_bytes; }

  Result<std::unique_ptr<ObjectWriter>> create(const std::string& key) override {
    auto k = key_of(key);
    if (!k.ok()) return k.status();
    return std::unique_ptr<ObjectWriter>(
        new S3Writer(c_, senders_, url_.bucket, k.value(), o_.part_bytes, o_.data_timeout_ms));
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

  std::shared_ptr<s3::Client> c_;
  std::shared_ptr<Senders> senders_;
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
