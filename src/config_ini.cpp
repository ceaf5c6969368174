// The strict CAF-syntax INI reader (config_ini.hpp).
#include "config_ini.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>

#include "text.hpp"

namespace ferry {
namespace {

// A config file is a few KiB; anything much larger is not one.
constexpr off_t kMaxIniBytes = 16 << 20;

// ---- INI ----

// Splits on '\n'; a trailing '\r' is removed so that CRLF files read the same.
std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  // A UTF-8 byte order mark is what some editors put first; it is not a key.
  if (text.compare(0, 3, "\xEF\xBB\xBF") == 0) start = 3;
  while (start <= text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(start, end - start);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(std::move(line));
    if (end == text.size()) break;
    start = end + 1;
  }
  return lines;
}

bool is_comment_start(char c) {
  return c == ';' || c == '#';
}

// Only blanks or a comment may follow a section header or a quoted value.
bool only_trailer(const std::string& s, size_t pos) {
  while (pos < s.size() && is_space(s[pos])) ++pos;
  return pos == s.size() || is_comment_start(s[pos]);
}

bool valid_key_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
}

class IniParser {
 public:
  IniParser(const std::string& text, const std::string& origin)
      : lines_(split_lines(text)), origin_(origin) {}

  Result<std::vector<Setting>> run() {
    for (size_t i = 0; i < lines_.size(); ++i) {
      line_no_ = i + 1;
      const std::string line = trim(lines_[i]);
      if (line.empty() || is_comment_start(line[0])) continue;
      Status st = line[0] == '[' ? section(line) : entry(line, i);
      if (!st.ok()) return st;
    }
    return std::move(out_);
  }

 private:
  Status error(const std::string& what) const {
    return Status::invalid_argument(origin_ + ":" + std::to_string(line_no_) + ": " + what);
  }

  Status section(const std::string& line) {
    const size_t close = line.find(']');
    if (close == std::string::npos) return error("unterminated section header " + line);
    if (!only_trailer(line, close + 1)) {
      return error("unexpected text after section header " + line.substr(0, close + 1));
    }
    section_ = trim(line.substr(1, close - 1));
    if (section_.empty()) return error("empty section name []");
    if (section_.compare(0, 6, "ferry.") == 0) {
      return error("nested section [" + section_ +
                   "] is not supported: put Ferry's keys directly in [ferry]");
    }
    return Status::ok_status();
  }

  Status entry(const std::string& line, size_t& index) {
    const size_t eq = line.find('=');
    if (eq == std::string::npos) return error("expected key = value, got " + quote_value(line));
    const std::string key = trim(line.substr(0, eq));
    if (key.empty()) return error("missing key before '='");
    if (!std::all_of(key.begin(), key.end(), valid_key_char)) {
      return error("invalid key " + quote_value(key) + " (letters, digits, '-', '_' and '.' only)");
    }
    const size_t first_line = line_no_;
    std::string value;
    FERRY_RETURN_IF_ERROR(read_value(trim(line.substr(eq + 1)), index, value));

    std::string ferry_key;
    if (section_ == "ferry") {
      ferry_key = key;
    } else if (key.compare(0, 6, "ferry.") == 0) {
      ferry_key = key.substr(6);
    } else {
      return Status::ok_status();  // CAF's or another library's key
    }
    out_.push_back({ferry_key, value, origin_ + ":" + std::to_string(first_line)});
    return Status::ok_status();
  }

  // `index` advances when a list or map value spans several lines.
  Status read_value(const std::string& raw, size_t& index, std::string& value) {
    if (!raw.empty() && raw[0] == '"') return read_quoted(raw, value);
    if (!raw.empty() && (raw[0] == '[' || raw[0] == '{')) return read_nested(raw, index, value);
    size_t end = 0;
    while (end < raw.size() && !is_comment_start(raw[end])) ++end;
    value = trim(raw.substr(0, end));
    return Status::ok_status();
  }

  Status read_quoted(const std::string& raw, std::string& value) {
    value.clear();
    for (size_t i = 1; i < raw.size(); ++i) {
      const char c = raw[i];
      if (c == '"') {
        if (!only_trailer(raw, i + 1)) return error("unexpected text after quoted value");
        return Status::ok_status();
      }
      if (c != '\\') {
        value += c;
        continue;
      }
      if (++i == raw.size()) break;
      switch (raw[i]) {
        case '"':
          value += '"';
          break;
        case '\\':
          value += '\\';
          break;
        case 'n':
          value += '\n';
          break;
        case 't':
          value += '\t';
          break;
        default:
          return error(std::string("unknown escape \\") + raw[i] + " in quoted value");
      }
    }
    return error("unterminated quoted value " + raw);
  }

  // CAF lists and maps ([1, 2], {a = 1}) may span lines. Ferry has no such
  // key, but CAF's sections do, and a valid CAF file must not read as broken.
  Status read_nested(const std::string& raw, size_t& index, std::string& value) {
    value.clear();
    int depth = 0;
    bool in_quote = false;
    std::string text = raw;
    for (;;) {
      for (size_t i = 0; i < text.size(); ++i) {
        const char c = text[i];
        if (in_quote) {
          if (c == '\\' && i + 1 < text.size()) {
            value += c;
            value += text[++i];
            continue;
          }
          if (c == '"') in_quote = false;
        } else if (c == '"') {
          in_quote = true;
        } else if (is_comment_start(c)) {
          break;
        } else if (c == '[' || c == '{') {
          ++depth;
        } else if (c == ']' || c == '}') {
          if (--depth == 0) {
            value += c;
            if (!only_trailer(text, i + 1)) return error("unexpected text after list");
            value = trim(value);
            return Status::ok_status();
          }
        }
        value += c;
      }
      if (in_quote) return error("unterminated quoted value " + trim(text));
      if (index + 1 >= lines_.size()) {
        return error("unterminated list or map (no closing bracket before end of file)");
      }
      text = lines_[++index];
      value += '\n';
    }
  }

  std::vector<std::string> lines_;
  std::string origin_;
  std::string section_;  // "" before the first header
  size_t line_no_ = 0;
  std::vector<Setting> out_;
};

}  // namespace

Result<std::string> read_ini_text(const std::string& path, const std::string& what) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return Status::not_found(what + " does not exist");
    return Status::io_error(what + ": cannot open: " + std::strerror(errno));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0)
    return Status::io_error(what + ": cannot stat: " + std::strerror(errno));
  if (S_ISDIR(st.st_mode))
    return Status::invalid_argument(what + " is a directory, not an INI file");
  if (!S_ISREG(st.st_mode)) return Status::invalid_argument(what + " is not a regular file");
  if (st.st_size > kMaxIniBytes)
    return Status::invalid_argument(what + " is " + std::to_string(st.st_size) +
                                    " bytes, more than a config file can be (" +
                                    std::to_string(kMaxIniBytes) + ")");
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::io_error(what + ": cannot read: " + std::strerror(errno));
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  text.resize(got);
  return text;
}

Result<std::vector<Setting>> read_ini_file(const std::string& path, const std::string& origin,
                                           const std::string& what) {
  FERRY_ASSIGN_OR_RETURN(std::string text, read_ini_text(path, what));
  return parse_ini_settings(text, origin);
}

Result<std::vector<Setting>> parse_ini_settings(const std::string& text,
                                                const std::string& origin) {
  return IniParser(text, origin).run();
}

Result<std::vector<Setting>> read_ini_settings(const std::string& path) {
  return read_ini_file(path, path, "config file " + path);
}

}  // namespace ferry
