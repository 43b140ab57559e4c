// Typed, error-naming access to JSON config objects (config.json, quantization configs).
#pragma once
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "io/json_util.h"
#include "wna16/error.h"

namespace wna16::io {

// A view of one JSON object; every error names the file, the key path and the bad value.
// A key holding null counts as absent (Hugging Face configs write null for "unset").
class Obj {
 public:
  using J = nlohmann::ordered_json;
  Obj(const J& j, std::string origin, std::string path) : j_(j), origin_(std::move(origin)), path_(std::move(path)) {}

  const J* get(const std::string& key) const {
    if (!j_.is_object()) return nullptr;
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  bool has(const std::string& key) const { return get(key) != nullptr; }
  std::string where(const std::string& key) const { return origin_ + ": " + path_ + key; }
  std::string value_str(const J& v) const {
    std::string s = v.dump();
    return s.size() > 120 ? s.substr(0, 120) + "..." : s;
  }

  int64_t req_int(const std::string& key, int64_t lo = std::numeric_limits<int64_t>::min(),
                  int64_t hi = std::numeric_limits<int64_t>::max()) const {
    const J* v = get(key);
    if (!v) throw Error(where(key) + " is missing");
    return as_int(key, *v, lo, hi);
  }
  int64_t opt_int(const std::string& key, int64_t def, int64_t lo = std::numeric_limits<int64_t>::min(),
                  int64_t hi = std::numeric_limits<int64_t>::max()) const {
    const J* v = get(key);
    return v ? as_int(key, *v, lo, hi) : def;
  }
  std::optional<int64_t> maybe_int(const std::string& key, int64_t lo, int64_t hi) const {
    const J* v = get(key);
    if (!v) return std::nullopt;
    return as_int(key, *v, lo, hi);
  }
  double opt_double(const std::string& key, double def) const {
    const J* v = get(key);
    if (!v) return def;
    if (!v->is_number()) throw Error(where(key) + " = " + value_str(*v) + " is not a number");
    double d = v->get<double>();
    if (!(d == d) || d > 1e30 || d < -1e30) throw Error(where(key) + " = " + value_str(*v) + " is not a finite number");
    return d;
  }
  bool opt_bool(const std::string& key, bool def) const {
    const J* v = get(key);
    if (!v) return def;
    if (!v->is_boolean()) throw Error(where(key) + " = " + value_str(*v) + " is not true or false");
    return v->get<bool>();
  }
  std::optional<bool> maybe_bool(const std::string& key) const {
    if (!has(key)) return std::nullopt;
    return opt_bool(key, false);
  }
  std::string req_str(const std::string& key) const {
    const J* v = get(key);
    if (!v) throw Error(where(key) + " is missing");
    if (!v->is_string()) throw Error(where(key) + " = " + value_str(*v) + " is not a string");
    return v->get<std::string>();
  }
  std::string opt_str(const std::string& key, const std::string& def) const { return has(key) ? req_str(key) : def; }
  std::vector<int64_t> opt_int_list(const std::string& key) const {
    std::vector<int64_t> out;
    const J* v = get(key);
    if (!v) return out;
    if (!v->is_array()) throw Error(where(key) + " = " + value_str(*v) + " is not a list of integers");
    for (const auto& e : *v) out.push_back(as_int(key, e, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()));
    return out;
  }
  // Several spellings of one field (`keys`, the canonical one first). pick() returns the spelling
  // present, or the canonical one when none is (so the opt_* accessors give their default); two
  // spellings holding different values are refused with both keys and values named.
  std::string pick(const std::vector<std::string>& keys) const {
    std::string found;
    for (const auto& k : keys) {
      const J* v = get(k);
      if (!v) continue;
      if (found.empty()) {
        found = k;
      } else if (*v != *get(found)) {
        throw Error(where(found) + " = " + value_str(*get(found)) + " and " + path_ + k + " = " + value_str(*v) +
                    " disagree (two spellings of one field)");
      }
    }
    return found.empty() ? keys.at(0) : found;
  }
  // "num_experts (or num_local_experts)": a field named with its accepted spellings.
  static std::string spellings(const std::vector<std::string>& keys) {
    std::string s = keys.at(0);
    for (size_t i = 1; i < keys.size(); ++i) s += (i == 1 ? " (or " : " or ") + keys[i];
    return keys.size() > 1 ? s + ")" : s;
  }
  int64_t req_int_any(const std::vector<std::string>& keys, int64_t lo, int64_t hi) const {
    const std::string k = pick(keys);
    if (!has(k)) throw Error(origin_ + ": " + path_ + spellings(keys) + " is missing");
    return req_int(k, lo, hi);
  }
  std::vector<std::string> opt_str_list(const std::string& key) const {
    std::vector<std::string> out;
    const J* v = get(key);
    if (!v) return out;
    if (!v->is_array()) throw Error(where(key) + " = " + value_str(*v) + " is not a list of strings");
    for (const auto& e : *v) {
      if (!e.is_string()) throw Error(where(key) + " holds " + value_str(e) + ", not a string");
      out.push_back(e.get<std::string>());
    }
    return out;
  }

 private:
  int64_t as_int(const std::string& key, const J& v, int64_t lo, int64_t hi) const {
    int64_t x = 0;
    if (v.is_number_unsigned()) {
      if (v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
        throw Error(where(key) + " = " + value_str(v) + " is out of range");
      x = int64_t(v.get<uint64_t>());
    } else if (v.is_number_integer()) {
      x = v.get<int64_t>();
    } else {
      throw Error(where(key) + " = " + value_str(v) + " is not an integer");
    }
    if (x < lo || x > hi)
      throw Error(where(key) + " = " + std::to_string(x) + " is out of range [" + std::to_string(lo) + ", " +
                  std::to_string(hi) + "]");
    return x;
  }
  const J& j_;
  std::string origin_, path_;
};

}  // namespace wna16::io
