// Strict JSON parsing shared by the safetensors header, index and config readers.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "wna16/error.h"

namespace wna16::io {

// Deeper nesting than any header or config needs; bounds the parser's and destructor's work.
inline constexpr int kMaxJsonDepth = 64;

// Parses `text` as one JSON value (whitespace around it allowed). Rejects invalid JSON or UTF-8,
// nesting deeper than kMaxJsonDepth and duplicate keys in any object (nlohmann would silently keep
// the last one; a duplicated tensor name must be an error). `origin` names the file in messages.
template <class Json>
Json parse_json_strict(std::string_view text, const std::string& origin) {
  struct DuplicateKey { std::string key; };
  struct TooDeep {};
  std::vector<std::unordered_set<std::string>> keys;  // one set per open object
  auto cb = [&](int depth, typename Json::parse_event_t ev, Json& parsed) -> bool {
    if (depth > kMaxJsonDepth) throw TooDeep{};
    switch (ev) {
      case Json::parse_event_t::object_start: keys.emplace_back(); break;
      case Json::parse_event_t::object_end: if (!keys.empty()) keys.pop_back(); break;
      case Json::parse_event_t::key:
        if (!keys.empty() && parsed.is_string() && !keys.back().insert(parsed.template get<std::string>()).second)
          throw DuplicateKey{parsed.template get<std::string>()};
        break;
      default: break;
    }
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), cb);
  } catch (const DuplicateKey& d) {
    throw Error(origin + ": duplicate key \"" + d.key + "\" in JSON");
  } catch (const TooDeep&) {
    throw Error(origin + ": JSON nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
  } catch (const nlohmann::json::exception& e) {
    throw Error(origin + ": invalid JSON: " + e.what());
  }
}

// Quotes a string for messages, cutting very long ones.
inline std::string quoted(const std::string& s) {
  if (s.size() > 200) return "\"" + s.substr(0, 200) + "...\"";
  return "\"" + s + "\"";
}

}  // namespace wna16::io
