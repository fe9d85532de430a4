#include "common/text/jinja/lexer.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/text/jinja/value.h"

namespace specd::jinja {
namespace {

// jinja2 joins the source's lines with "\n" and drops one trailing newline.
std::string NormalizeNewlines(absl::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out.push_back('\n');
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out.push_back(source[i]);
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

bool IsAsciiSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

// The code point at byte `pos` of `s` and its length in bytes (1 for a byte that is not UTF-8).
std::pair<uint32_t, size_t> CodePointAt(absl::string_view s, size_t pos) {
  const size_t n = std::min<size_t>(4, s.size() - pos);
  const std::vector<uint32_t> cps = DecodeUtf8(s.substr(pos, n));
  std::string first;
  AppendUtf8(cps[0], &first);
  return {cps[0], first.size()};
}

// Python's str.rstrip() with no argument.
absl::string_view RstripPython(absl::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    // Step back to the start of the last character (at most 3 continuation bytes).
    size_t start = end - 1;
    while (start > 0 && end - start < 4 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) {
      --start;
    }
    const auto [cp, len] = CodePointAt(s, start);
    if (start + len != end || !IsPythonSpace(cp)) break;
    end = start;
  }
  return s.substr(0, end);
}

// Length of the Python whitespace run (\s*) at `pos`.
size_t SpaceRun(absl::string_view s, size_t pos) {
  size_t i = pos;
  while (i < s.size()) {
    const auto [cp, len] = CodePointAt(s, i);
    if (!IsPythonSpace(cp)) break;
    i += len;
  }
  return i - pos;
}

bool AllPythonSpace(absl::string_view s) { return !s.empty() && SpaceRun(s, 0) == s.size(); }

class Lexer {
 public:
  explicit Lexer(absl::string_view source) : src_(NormalizeNewlines(source)) {
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i) {
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
    }
  }

  absl::StatusOr<std::vector<Token>> Run() {
    size_t pos = 0;
    bool line_starting = true;
    while (pos < src_.size()) {
      const size_t start = NextTagStart(pos);
      if (start == std::string::npos) {
        Emit(TokenType::kData, src_.substr(pos), pos);
        break;
      }
      const char kind = src_[start + 1];
      size_t p = start + 2;
      char sign = 0;
      if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) sign = src_[p++];
      absl::string_view text(src_.data() + pos, start - pos);
      if (sign == '-') {
        text = RstripPython(text);
      } else if (sign != '+' && kind != '{') {
        // lstrip_blocks: a block or comment tag alone on its line loses the indentation
        // before it.
        const size_t line_pos = text.rfind('\n') + 1;  // npos + 1 == 0
        if ((line_pos > 0 || line_starting) && AllPythonSpace(text.substr(line_pos))) {
          text = text.substr(0, line_pos);
        }
      }
      if (!text.empty()) Emit(TokenType::kData, text, pos);

      absl::StatusOr<size_t> end;
      if (kind == '#') {
        end = Comment(p, start);
      } else if (kind == '%' && IsRaw(p)) {
        end = Raw(p, start);
      } else {
        end = Tag(kind == '{', start, p);
      }
      if (!end.ok()) return end.status();
      line_starting = *end > 0 && src_[*end - 1] == '\n';
      pos = *end;
    }
    Token eof;
    eof.type = TokenType::kEof;
    Locate(src_.size(), &eof);
    tokens_.push_back(std::move(eof));
    return std::move(tokens_);
  }

 private:
  size_t NextTagStart(size_t pos) const {
    for (size_t i = src_.find('{', pos); i != std::string::npos; i = src_.find('{', i + 1)) {
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) {
        return i;
      }
    }
    return std::string::npos;
  }

  void Locate(size_t offset, Token* t) const {
    const auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset);
    t->line = static_cast<int>(it - line_starts_.begin());
    t->column = static_cast<int>(offset - line_starts_[t->line - 1]) + 1;
  }

  void Emit(TokenType type, absl::string_view text, size_t offset) {
    Token t;
    t.type = type;
    t.text = std::string(text);
    Locate(offset, &t);
    tokens_.push_back(std::move(t));
  }

  absl::Status Error(size_t offset, absl::string_view message) const {
    Token t;
    Locate(offset, &t);
    return absl::InvalidArgumentError(
        absl::StrCat("line ", t.line, ", column ", t.column, ": ", message));
  }

  // End of the block tag closing at `at` ("+%}", "-%}" and following whitespace, or "%}" and
  // one newline: trim_blocks), or npos when none starts there.
  size_t BlockEndAt(size_t at) const {
    absl::string_view rest(src_.data() + at, src_.size() - at);
    if (rest.substr(0, 3) == "+%}") return at + 3;
    if (rest.substr(0, 3) == "-%}") return at + 3 + SpaceRun(src_, at + 3);
    if (rest.substr(0, 2) == "%}") return at + 2 + (rest.substr(2, 1) == "\n" ? 1 : 0);
    return std::string::npos;
  }

  absl::StatusOr<size_t> Comment(size_t body, size_t start) {
    const size_t close = src_.find("#}", body);
    if (close == std::string::npos) return Error(start, "missing end of comment tag");
    if (close > body && src_[close - 1] == '+') return close + 2;
    if (close > body && src_[close - 1] == '-') return close + 2 + SpaceRun(src_, close + 2);
    return close + 2 + (close + 2 < src_.size() && src_[close + 2] == '\n' ? 1 : 0);
  }

  // {% raw %} (with optional whitespace control) starts at the tag body `p`?
  bool IsRaw(size_t p) const {
    size_t i = p;
    while (i < src_.size() && IsAsciiSpace(src_[i])) ++i;
    if (src_.compare(i, 3, "raw") != 0) return false;
    i += 3;
    while (i < src_.size() && IsAsciiSpace(src_[i])) ++i;
    return src_.compare(i, 3, "-%}") == 0 || src_.compare(i, 2, "%}") == 0;
  }

  absl::StatusOr<size_t> Raw(size_t p, size_t start) {
    size_t i = src_.find("raw", p) + 3;
    while (IsAsciiSpace(src_[i])) ++i;
    // The raw start tag has no trim_blocks newline; "-%}" strips what follows it.
    size_t body = src_[i] == '-' ? i + 3 + SpaceRun(src_, i + 3) : i + 2;
    for (size_t tag = src_.find("{%", body); tag != std::string::npos;
         tag = src_.find("{%", tag + 2)) {
      size_t j = tag + 2;
      char sign = 0;
      if (j < src_.size() && (src_[j] == '-' || src_[j] == '+')) sign = src_[j++];
      while (j < src_.size() && IsAsciiSpace(src_[j])) ++j;
      if (src_.compare(j, 6, "endraw") != 0) continue;
      j += 6;
      while (j < src_.size() && IsAsciiSpace(src_[j])) ++j;
      const size_t end = BlockEndAt(j);
      if (end == std::string::npos) continue;
      absl::string_view text(src_.data() + body, tag - body);
      if (sign == '-') {
        text = RstripPython(text);
      } else if (sign != '+') {
        const size_t line_pos = text.rfind('\n') + 1;
        if (line_pos > 0 && AllPythonSpace(text.substr(line_pos))) text = text.substr(0, line_pos);
      }
      if (!text.empty()) Emit(TokenType::kData, text, body);
      return end;
    }
    return Error(start, "missing end of raw directive");
  }

  // Lexes the inside of {{ ... }} or {% ... %} from `p`; returns the offset after its end.
  absl::StatusOr<size_t> Tag(bool variable, size_t start, size_t p) {
    Emit(variable ? TokenType::kVariableBegin : TokenType::kBlockBegin, variable ? "{{" : "{%",
         start);
    std::vector<char> balance;
    size_t i = p;
    while (true) {
      if (balance.empty()) {
        size_t end = std::string::npos;
        if (variable) {
          if (src_.compare(i, 3, "-}}") == 0) end = i + 3 + SpaceRun(src_, i + 3);
          if (src_.compare(i, 2, "}}") == 0) end = i + 2;
        } else {
          end = BlockEndAt(i);
        }
        if (end != std::string::npos) {
          Emit(variable ? TokenType::kVariableEnd : TokenType::kBlockEnd, "", i);
          return end;
        }
      }
      if (i >= src_.size()) {
        return Error(start, variable ? "unexpected end of template: '{{' is never closed"
                                     : "unexpected end of template: '{%' is never closed");
      }
      const char c = src_[i];
      if (IsAsciiSpace(c)) {
        ++i;
        continue;
      }
      absl::StatusOr<size_t> next;
      if (absl::ascii_isdigit(c)) {
        next = Number(i);
      } else if (absl::ascii_isalpha(c) || c == '_') {
        size_t j = i + 1;
        while (j < src_.size() && (absl::ascii_isalnum(src_[j]) || src_[j] == '_')) ++j;
        Emit(TokenType::kName, absl::string_view(src_.data() + i, j - i), i);
        next = j;
      } else if (c == '\'' || c == '"') {
        next = String(i);
      } else {
        next = Operator(i, &balance);
      }
      if (!next.ok()) return next.status();
      i = *next;
    }
  }

  absl::StatusOr<size_t> Operator(size_t i, std::vector<char>* balance) {
    static constexpr absl::string_view kTwo[] = {"//", "**", "==", "!=", ">=", "<="};
    for (absl::string_view op : kTwo) {
      if (src_.compare(i, 2, op.data(), op.size()) == 0) {
        Emit(TokenType::kOperator, op, i);
        return i + 2;
      }
    }
    const char c = src_[i];
    static constexpr absl::string_view kOne = "+-/*%~[](){}><=.:|,;";
    if (kOne.find(c) == absl::string_view::npos) {
      return Error(i, absl::StrCat("unexpected character '", std::string(1, c), "'"));
    }
    if (c == '(' || c == '[' || c == '{') {
      balance->push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
    } else if (c == ')' || c == ']' || c == '}') {
      if (balance->empty()) return Error(i, absl::StrCat("unexpected '", std::string(1, c), "'"));
      if (balance->back() != c) {
        return Error(i, absl::StrCat("unexpected '", std::string(1, c), "', expected '",
                                     std::string(1, balance->back()), "'"));
      }
      balance->pop_back();
    }
    Emit(TokenType::kOperator, absl::string_view(&src_[i], 1), i);
    return i + 1;
  }

  // Digits with single underscores between them, from `i`; returns the end (i when none).
  size_t Digits(size_t i) const {
    size_t j = i;
    while (j < src_.size() && absl::ascii_isdigit(src_[j])) {
      ++j;
      if (j + 1 < src_.size() && src_[j] == '_' && absl::ascii_isdigit(src_[j + 1])) ++j;
    }
    return j;
  }

  absl::StatusOr<size_t> Number(size_t i) {
    auto clean = [&](size_t from, size_t to) {
      std::string s;
      for (size_t k = from; k < to; ++k) {
        if (src_[k] != '_') s.push_back(src_[k]);
      }
      return s;
    };
    // Radix prefixes: 0b, 0o, 0x.
    if (src_[i] == '0' && i + 2 < src_.size()) {
      const char r = absl::ascii_tolower(src_[i + 1]);
      const int base = r == 'b' ? 2 : r == 'o' ? 8 : r == 'x' ? 16 : 0;
      if (base != 0) {
        size_t j = i + 2;
        while (j < src_.size() && (absl::ascii_isxdigit(src_[j]) || src_[j] == '_')) ++j;
        const std::string digits = clean(i + 2, j);
        Token t;
        t.type = TokenType::kInteger;
        t.int_value = std::strtoll(digits.c_str(), nullptr, base);
        t.text = src_.substr(i, j - i);
        Locate(i, &t);
        tokens_.push_back(std::move(t));
        return j;
      }
    }
    size_t j = Digits(i);
    bool is_float = false;
    // jinja2 reads "x.0.1" as x . 0 . 1, not x . 0.1: no float right after a dot.
    const bool after_dot = i > 0 && src_[i - 1] == '.';
    if (!after_dot) {
      size_t k = j;
      if (k + 1 < src_.size() && src_[k] == '.' && absl::ascii_isdigit(src_[k + 1])) {
        k = Digits(k + 1);
        is_float = true;
      }
      if (k < src_.size() && (src_[k] == 'e' || src_[k] == 'E')) {
        size_t e = k + 1;
        if (e < src_.size() && (src_[e] == '+' || src_[e] == '-')) ++e;
        if (e < src_.size() && absl::ascii_isdigit(src_[e])) {
          k = Digits(e);
          is_float = true;
        }
      }
      if (is_float) j = k;
    }
    const std::string text = clean(i, j);
    Token t;
    t.text = src_.substr(i, j - i);
    Locate(i, &t);
    if (is_float) {
      t.type = TokenType::kFloat;
      t.float_value = std::strtod(text.c_str(), nullptr);
    } else {
      t.type = TokenType::kInteger;
      errno = 0;
      t.int_value = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == ERANGE) return Error(i, "integer literal is too large");
    }
    tokens_.push_back(std::move(t));
    return j;
  }

  // A quoted literal, decoded as Python's unicode-escape codec does.
  absl::StatusOr<size_t> String(size_t i) {
    const char quote = src_[i];
    std::string value;
    size_t j = i + 1;
    auto hex = [&](size_t from, int n, uint32_t* cp) {
      if (from + n > src_.size()) return false;
      *cp = 0;
      for (int k = 0; k < n; ++k) {
        const char h = src_[from + k];
        if (!absl::ascii_isxdigit(h)) return false;
        *cp = *cp * 16 + (absl::ascii_isdigit(h) ? h - '0' : absl::ascii_tolower(h) - 'a' + 10);
      }
      return true;
    };
    while (true) {
      if (j >= src_.size()) return Error(i, "unterminated string literal");
      const char c = src_[j];
      if (c == quote) break;
      if (c != '\\') {
        value.push_back(c);
        ++j;
        continue;
      }
      if (j + 1 >= src_.size()) return Error(i, "unterminated string literal");
      const char e = src_[j + 1];
      j += 2;
      switch (e) {
        case '\\':
          value.push_back('\\');
          break;
        case '\'':
          value.push_back('\'');
          break;
        case '"':
          value.push_back('"');
          break;
        case 'a':
          value.push_back('\a');
          break;
        case 'b':
          value.push_back('\b');
          break;
        case 'f':
          value.push_back('\f');
          break;
        case 'n':
          value.push_back('\n');
          break;
        case 'r':
          value.push_back('\r');
          break;
        case 't':
          value.push_back('\t');
          break;
        case 'v':
          value.push_back('\v');
          break;
        case '\n':
          break;  // line continuation
        case 'x':
        case 'u':
        case 'U': {
          const int n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          uint32_t cp;
          if (!hex(j, n, &cp) || cp > 0x10FFFF) {
            return Error(j - 2, absl::StrCat("truncated or invalid \\", std::string(1, e),
                                             " escape in a string literal"));
          }
          AppendUtf8(cp, &value);
          j += n;
          break;
        }
        case 'N':
          return Error(j - 2, "\\N{...} escapes are not supported");
        default:
          if (e >= '0' && e <= '7') {
            uint32_t cp = e - '0';
            for (int k = 0; k < 2 && j < src_.size() && src_[j] >= '0' && src_[j] <= '7'; ++k) {
              cp = cp * 8 + (src_[j++] - '0');
            }
            AppendUtf8(cp, &value);
          } else {
            // Python keeps an unknown escape as it is.
            value.push_back('\\');
            value.push_back(e);
          }
      }
    }
    Token t;
    t.type = TokenType::kString;
    t.text = std::move(value);
    Locate(i, &t);
    tokens_.push_back(std::move(t));
    return j + 1;
  }

  const std::string src_;
  std::vector<size_t> line_starts_;
  std::vector<Token> tokens_;
};

}  // namespace

absl::StatusOr<std::vector<Token>> Tokenize(absl::string_view source) {
  return Lexer(source).Run();
}

}  // namespace specd::jinja
