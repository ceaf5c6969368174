// The FERRY_FAULTS spec: its grammar (see fault_fs.hpp) parsed into fault
// rules, and rules written back in the same form.
#include "drills/fault_fs.hpp"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>

#include "drills/fields.hpp"
#include "text.hpp"  // src/text.hpp: trim

namespace ferry {

using drills::parse_duration;
using drills::parse_u64;
using drills::split;

namespace {

constexpr std::array<const char*, kFaultOpCount> kOpNames = {
    "open", "write", "read", "sync", "rename", "mkdir", "unlink", "rmdir", "truncate", "close"};

}  // namespace

const char* fault_op_name(FaultOp op) {
  return kOpNames[static_cast<size_t>(op)];
}

std::string FaultRule::to_string() const {
  std::string s;
  switch (action) {
    case Action::error:
      s = error == EIO ? "eio" : error == ENOSPC ? "enospc" : "errno" + std::to_string(error);
      break;
    case Action::short_write:
      s = "short";
      break;
    case Action::latency:
      s = "latency";
      break;
    case Action::stall:
      s = "stall";
      break;
  }
  s += ":";
  s += any_op ? "any" : fault_op_name(op);
  if (action == Action::latency) {
    s += ":" + std::to_string(latency.count()) + "us";
    if (per_bytes > 0) s += ":per=" + std::to_string(per_bytes);
  } else if (nth > 0) {
    s += ":" + std::to_string(nth) + (sticky ? "+" : "");
  } else {
    s += ":rate=" + std::to_string(rate_num) + "/" + std::to_string(rate_den) +
         ":seed=" + std::to_string(seed);
  }
  if (!path_contains.empty()) s += ":path=" + path_contains;
  return s;
}

namespace {

Status bad_spec(const std::string& part, const std::string& why) {
  return Status::invalid_argument("fault spec: '" + part + "': " + why);
}

bool parse_rate(const std::string& v, uint64_t* num, uint64_t* den) {
  size_t slash = v.find('/');
  if (slash == std::string::npos) return false;
  return parse_u64(v.substr(0, slash), num) && parse_u64(v.substr(slash + 1), den) && *den > 0 &&
         *num <= *den;
}

// A rule as written, and which defaults it leaves to the spec's global
// path= and seed= items.
struct ParsedFault {
  FaultRule rule;
  bool own_seed = false;
  bool own_path = false;
};

Result<ParsedFault> parse_fault(const std::string& item) {
  std::vector<std::string> parts = split(item, ':');
  ParsedFault parsed;
  FaultRule& r = parsed.rule;
  const std::string& action = parts[0];
  if (action == "enospc") {
    r.action = FaultRule::Action::error;
    r.error = ENOSPC;
  } else if (action == "eio") {
    r.action = FaultRule::Action::error;
    r.error = EIO;
  } else if (action == "short") {
    r.action = FaultRule::Action::short_write;
    r.error = ENOSPC;
  } else if (action == "latency") {
    r.action = FaultRule::Action::latency;
  } else if (action == "stall") {
    r.action = FaultRule::Action::stall;
  } else {
    return bad_spec(item,
                    "unknown fault '" + action +
                        "' (expected enospc, eio, short, latency or stall, http:..., or journal=, "
                        "path=, seed=)");
  }
  if (parts.size() < 2 || parts[1].empty())
    return bad_spec(item, "missing the operation after '" + action + ":'");
  if (parts[1] == "any") {
    r.any_op = true;
  } else {
    auto it = std::find(kOpNames.begin(), kOpNames.end(), parts[1]);
    if (it == kOpNames.end())
      return bad_spec(item, "unknown operation '" + parts[1] +
                                "' (expected open, write, read, sync, rename, mkdir, unlink, "
                                "rmdir, truncate, close or any)");
    r.op = static_cast<FaultOp>(it - kOpNames.begin());
  }
  if (r.action == FaultRule::Action::short_write && (r.any_op || r.op != FaultOp::write))
    return bad_spec(item, "a short write only applies to the operation 'write'");

  bool have_trigger = false;
  for (size_t i = 2; i < parts.size(); ++i) {
    const std::string& p = parts[i];
    size_t eq = p.find('=');
    if (eq != std::string::npos) {
      const std::string key = p.substr(0, eq), value = p.substr(eq + 1);
      if (key == "rate" && r.action != FaultRule::Action::latency) {
        if (have_trigger) return bad_spec(item, "more than one trigger ('" + p + "')");
        if (!parse_rate(value, &r.rate_num, &r.rate_den))
          return bad_spec(item, "bad rate '" + value + "' (expected A/B with 0 <= A <= B, B > 0)");
        have_trigger = true;
      } else if (key == "seed" && r.action != FaultRule::Action::latency) {
        if (!parse_u64(value, &r.seed)) return bad_spec(item, "bad seed '" + value + "'");
        parsed.own_seed = true;
      } else if (key == "per" && r.action == FaultRule::Action::latency) {
        if (!parse_u64(value, &r.per_bytes) || r.per_bytes == 0)
          return bad_spec(item, "bad per '" + value + "' (expected bytes > 0)");
      } else if (key == "path") {
        if (value.empty()) return bad_spec(item, "empty path filter");
        r.path_contains = value;
        parsed.own_path = true;
      } else {
        return bad_spec(item, "unknown option '" + p + "'");
      }
      continue;
    }
    if (have_trigger) return bad_spec(item, "more than one trigger ('" + p + "')");
    have_trigger = true;
    if (r.action == FaultRule::Action::latency) {
      if (!parse_duration(p, &r.latency))
        return bad_spec(item, "bad duration '" + p + "' (expected e.g. 250us, 5ms, 1s)");
      continue;
    }
    std::string count = p;
    if (!count.empty() && count.back() == '+') {
      r.sticky = true;
      count.pop_back();
    }
    if (!parse_u64(count, &r.nth) || r.nth == 0)
      return bad_spec(item, "bad trigger '" + p + "' (expected N >= 1, N+ or rate=A/B)");
  }
  if (!have_trigger)
    return bad_spec(item, r.action == FaultRule::Action::latency
                              ? "missing the duration (e.g. latency:write:5ms)"
                              : "missing the trigger (N, N+ or rate=A/B)");
  if (parsed.own_seed && r.nth > 0) return bad_spec(item, "seed= only goes with rate=");
  return parsed;
}

}  // namespace

Result<FaultOptions> parse_fault_spec(const std::string& spec) {
  FaultOptions out;
  std::string default_path;
  uint64_t default_seed = 1;
  std::vector<ParsedFault> faults;
  for (const std::string& raw : split(spec, ',')) {
    const std::string item = trim(raw);
    if (item.empty()) {
      if (trim(spec).empty()) break;
      return Status::invalid_argument("fault spec '" + spec + "': empty item");
    }
    if (item.compare(0, 8, "journal=") == 0) {
      if (item.size() == 8) return bad_spec(item, "empty journal path");
      out.journal_path = item.substr(8);
    } else if (item.compare(0, 5, "path=") == 0) {
      if (item.size() == 5) return bad_spec(item, "empty path filter");
      default_path = item.substr(5);
    } else if (item.compare(0, 5, "http:") == 0) {
      FERRY_ASSIGN_OR_RETURN(HttpFaultRule h, parse_http_fault(item));
      out.http_rules.push_back(std::move(h));
    } else if (item.compare(0, 5, "seed=") == 0) {
      if (!parse_u64(item.substr(5), &default_seed))
        return bad_spec(item, "bad seed '" + item.substr(5) + "'");
    } else {
      FERRY_ASSIGN_OR_RETURN(ParsedFault f, parse_fault(item));
      faults.push_back(std::move(f));
    }
  }
  // Global items apply wherever they stand in the spec.
  for (ParsedFault& f : faults) {
    if (!f.own_path) f.rule.path_contains = default_path;
    if (!f.own_seed) f.rule.seed = default_seed;
    out.rules.push_back(std::move(f.rule));
  }
  return out;
}

Result<std::shared_ptr<Filesystem>> filesystem_from_spec(std::shared_ptr<Filesystem> base,
                                                         const std::string& spec) {
  FERRY_ASSIGN_OR_RETURN(FaultOptions options, parse_fault_spec(spec));
  if (options.rules.empty() && options.journal_path.empty()) return base;
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<FaultFilesystem> fs,
                         FaultFilesystem::create(std::move(base), std::move(options)));
  return std::shared_ptr<Filesystem>(std::move(fs));
}

Result<std::shared_ptr<Filesystem>> filesystem_from_env(std::shared_ptr<Filesystem> base,
                                                        const char* var) {
  const char* spec = std::getenv(var);
  if (spec == nullptr || *spec == '\0') return base;
  Result<std::shared_ptr<Filesystem>> fs = filesystem_from_spec(std::move(base), spec);
  if (!fs.ok()) return fs.status().with_context(std::string(var) + ": ");
  return fs;
}

}  // namespace ferry
