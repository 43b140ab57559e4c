// ModulePattern: module-name patterns from untrusted configs (GPTQModel `dynamic` keys), written in
// Python `re` syntax, compiled and matched by RE2. RE2 builds an automaton and never backtracks:
// matching is linear in the name, memory is bounded by max_mem, and malformed input is an error
// code, not undefined behaviour, so no pre-check per engine defect is needed here.
//
// Python re and RE2 read the common syntax alike (., *, +, ?, {m,n}, classes, \d \w \s \b, \A,
// (?:...), (?P<name>...), inline flags (?i) (?s) (?m), leftmost-first alternation). Where they
// differ, this file bridges or refuses, never silently changes the meaning:
//   \Z            Python's end of string is RE2's \z: rewritten.
//   {,n} {,}      Python's counted repetition with the minimum left out ({0,n}); RE2 would read
//                 the braces as literal text: rewritten to {0,n} / {0,}.
//   \1 .. \99     Python backreferences (RE2 would refuse \1, but read \12 as an octal escape):
//                 refused, as is (?P=name). Three octal digits (\101) mean the same in both.
//   (?= (?! (?<= (?<! lookaround, (?> atomic groups, (?( conditionals: no linear-time
//                 equivalent; refused with a message saying which. Possessive repeats (a*+, a++)
//                 are refused by RE2 as a repetition of a repetition, and said so.
//   everything else RE2 refuses (e.g. (?x), \u0041) is reported with RE2's own description.
#include <re2/re2.h>

#include "wna16/checkpoint.h"
#include "wna16/error.h"

namespace wna16 {

struct ModulePattern::Impl {
  std::string source;
  std::unique_ptr<RE2> re;
};

namespace {

// Bytes the compiled program and its lazily built DFA may use, per pattern. Real rules need a few
// KiB; past this RE2 refuses the pattern at compile time, or falls back to its (also linear) NFA
// while matching.
constexpr int64_t kMaxMem = 4 << 20;

bool is_octal(char c) { return c >= '0' && c <= '7'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

std::string shown(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[u >> 4];
      out += hex[u & 15];
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// Rewrites the Python-only spellings RE2 reads differently (see the top of the file) and refuses
// the constructs that need backtracking. One pass, tracking escapes and character classes (where
// "(", "{" and "$" are literal).
std::string python_to_re2(std::string_view re, const std::string& where) {
  std::string out;
  out.reserve(re.size() + 8);
  bool in_class = false;
  size_t class_body = 0;  // index of the first character of the class body (a "]" there is literal)
  const size_t n = re.size();
  auto refuse = [&](const std::string& what) { throw Error(where + ": " + what); };
  const std::string no_linear = " is not supported (it has no linear-time matching)";
  for (size_t i = 0; i < n; ++i) {
    const char c = re[i];
    if (c == '\\') {
      if (i + 1 >= n) {
        out += c;  // a trailing backslash: RE2 reports it
        break;
      }
      const char d = re[i + 1];
      // Outside a class, Python reads \N and \NN as group references and only three octal digits
      // as a character (as RE2 does); inside a class both read octal digits alike (or refuse).
      if (d >= '1' && d <= '9' && !in_class) {
        const bool octal3 = i + 3 < n && is_octal(d) && is_octal(re[i + 2]) && is_octal(re[i + 3]);
        if (octal3 && d >= '4') refuse("the escape " + std::string(re.substr(i, 4)) +
                                       " is refused: backreferences are not supported, and as an octal escape it is above \\377 (an error in Python re)");
        if (!octal3) {
          size_t k = i + 1;
          while (k < n && k < i + 3 && is_digit(re[k])) ++k;
          refuse("backreferences (here " + std::string(re.substr(i, k - i)) +
                 ") are not supported: they have no linear-time matching (a backslash before a digit is a group "
                 "reference in Python re; an octal escape takes three digits, \\101)");
        }
      }
      if (d == 'Z' && !in_class) {
        out += "\\z";  // Python's \Z: end of the string
      } else {
        out += c;
        out += d;
      }
      ++i;
      continue;
    }
    if (in_class) {
      if (c == ']' && i > class_body) in_class = false;
      out += c;
      continue;
    }
    if (c == '[') {
      in_class = true;
      class_body = i + 1;
      if (class_body < n && re[class_body] == '^') ++class_body;
      out += c;
      continue;
    }
    if (c == '(' && i + 1 < n && re[i + 1] == '?') {
      const std::string_view rest = re.substr(i + 1);
      if (rest.starts_with("?=") || rest.starts_with("?!")) refuse("the lookahead " + std::string(re.substr(i, 3)) + "...)" + no_linear);
      if (rest.starts_with("?<=") || rest.starts_with("?<!")) refuse("the lookbehind " + std::string(re.substr(i, 4)) + "...)" + no_linear);
      if (rest.starts_with("?P=")) refuse("backreferences (here (?P=...)) are not supported: they have no linear-time matching");
      if (rest.starts_with("?>")) refuse("the atomic group (?>...)" + no_linear);
      if (rest.starts_with("?(")) refuse("the conditional group (?(...)...)" + no_linear);
    }
    if (c == '{' && i + 1 < n && re[i + 1] == ',') {
      size_t k = i + 2;
      while (k < n && is_digit(re[k])) ++k;
      if (k < n && re[k] == '}') {
        out += "{0";  // Python's {,n}: zero to n
        continue;     // the ',' follows in the next iteration
      }
    }
    out += c;
  }
  return out;
}

}  // namespace

ModulePattern ModulePattern::compile(std::string_view regex, const std::string& where) {
  if (regex.size() > kMaxLength)
    throw Error(where + ": pattern longer than " + std::to_string(kMaxLength) + " characters (" + std::to_string(regex.size()) + ")");
  const std::string translated = python_to_re2(regex, where);
  RE2::Options opt;
  opt.set_encoding(RE2::Options::EncodingUTF8);
  opt.set_log_errors(false);  // errors come back as codes and become our messages; nothing on stderr
  opt.set_max_mem(kMaxMem);
  opt.set_never_capture(true);  // only "does it match" is asked: no submatch bookkeeping
  opt.set_longest_match(false);  // leftmost-first, as Python
  auto impl = std::make_shared<Impl>();
  impl->source = std::string(regex);
  impl->re = std::make_unique<RE2>(re2::StringPiece(translated.data(), translated.size()), opt);
  const RE2& re = *impl->re;
  if (!re.ok()) {
    const std::string arg = shown(re.error_arg());
    switch (re.error_code()) {
      case RE2::ErrorRepeatSize:
        throw Error(where + ": counted repetitions ({n}) above 1000, nested ones multiplied, are not supported (" +
                    re.error() + ")");
      case RE2::ErrorRepeatOp:
        throw Error(where + ": a repetition applied to a repetition (" + arg +
                    ": possessive repeats such as a*+ or stacked counted repetitions such as a{2}{3}) is not supported");
      case RE2::ErrorBadUTF8:
        throw Error(where + ": the pattern is not valid UTF-8");
      case RE2::ErrorPatternTooLarge:
        throw Error(where + ": the pattern compiles to more than " + std::to_string(kMaxMem >> 20) +
                    " MiB of automaton; use fewer or smaller counted repetitions and character classes");
      default:
        throw Error(where + ": not a regular expression wna16 can compile (Python re syntax, read by RE2): " + re.error());
    }
  }
  ModulePattern p;
  p.impl_ = std::move(impl);
  return p;
}

bool ModulePattern::matches(std::string_view module) const {
  if (!impl_) return false;
  return impl_->re->Match(re2::StringPiece(module.data(), module.size()), 0, module.size(), RE2::ANCHOR_START, nullptr, 0);
}

const std::string& ModulePattern::source() const {
  static const std::string empty;
  return impl_ ? impl_->source : empty;
}

}  // namespace wna16
