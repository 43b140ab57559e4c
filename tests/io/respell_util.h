// Re-saving a checkpoint's config.json with the other spelling of every aliased key, as the
// checkpoint matrix does (tests/io/matrix_test.cpp; scripts/checkpoint-matrix does the same in
// Python). The spellings come from the library's own tables, read from its source so that there is
// one list: kKeyAliases and kArchs in src/io/model_config.cpp, kQuantKeys in src/io/quant_config.cpp.
// Every line of those tables must parse as a row (a new row shape fails the test rather than being
// skipped).
#pragma once
#include <algorithm>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "io_test_util.h"

namespace wna16::test {

struct ModelKeyAlias {
  std::string model_type, canonical, alternative;
};
struct QuantKeySpelling {
  std::string field, spelling;
  bool negated = false;
};
struct SpellingTables {
  std::vector<ModelKeyAlias> model;
  std::vector<QuantKeySpelling> quant;
};

// The library source file `rel` (e.g. "src/io/model_config.cpp"), found from WNA16_TEST_DATA
// (<source>/tests/data).
inline std::string library_source(const std::string& rel) {
  const std::string path = std::string(WNA16_TEST_DATA) + "/../../" + rel;
  const std::string text = read_file(path);
  if (text.empty()) throw std::runtime_error("cannot read " + path);
  return text;
}

// The lines between `opening` (e.g. "constexpr KeyAlias kKeyAliases[] = {") and the next "};",
// without blank and comment lines; each must match `row`; the captures of each row.
inline std::vector<std::vector<std::string>> table_rows(const std::string& text, const std::string& opening, const std::regex& row,
                                           const std::string& file) {
  const size_t a = text.find(opening);
  if (a == std::string::npos) throw std::runtime_error(file + ": no \"" + opening + "\"");
  const size_t body = a + opening.size(), b = text.find("\n};", body);
  if (b == std::string::npos) throw std::runtime_error(file + ": " + opening + " is not closed");
  std::vector<std::vector<std::string>> rows;
  std::istringstream in(text.substr(body, b - body));
  for (std::string line; std::getline(in, line);) {
    const size_t s = line.find_first_not_of(" \t");
    if (s == std::string::npos || line.compare(s, 2, "//") == 0) continue;
    const std::string l = line.substr(s);
    std::smatch m;
    if (!std::regex_match(l, m, row)) throw std::runtime_error(file + ": table line not understood: " + l);
    rows.emplace_back(m.begin(), m.end());
  }
  return rows;
}

inline SpellingTables spelling_tables() {
  SpellingTables t;
  const std::string mc = library_source("src/io/model_config.cpp");
  std::map<std::string, std::string> arch_of;  // Arch::Mixtral -> "mixtral"
  for (const auto& m : table_rows(mc, "constexpr ArchRow kArchs[] = {", std::regex(R"re(\{Arch::(\w+), "(\w+)"\},)re"),
                                  "src/io/model_config.cpp"))
    arch_of[m[1]] = m[2];
  for (const auto& m : table_rows(mc, "constexpr KeyAlias kKeyAliases[] = {",
                                  std::regex(R"re(\{Arch::(\w+), "(\w+)", "(\w+)"\},)re"), "src/io/model_config.cpp")) {
    if (!arch_of.count(m[1])) throw std::runtime_error("src/io/model_config.cpp: kKeyAliases names Arch::" + m[1] + ", not in kArchs");
    t.model.push_back({arch_of[m[1]], m[2], m[3]});
  }
  const std::string qc = library_source("src/io/quant_config.cpp");
  for (const auto& m : table_rows(qc, "constexpr QuantKey kQuantKeys[] = {",
                                  std::regex(R"re(\{"(\w+)", "(\w+)", (true|false)\},)re"), "src/io/quant_config.cpp"))
    t.quant.push_back({m[1], m[2], m[3] == "true"});
  return t;
}

// config.json text re-saved with the other spelling of every aliased key present, the way
// transformers saves a config (keys sorted, indent 2). Model config: per kKeyAliases row of this
// model_type, canonical -> alternative when only the canonical key is present, and back when only
// the alternative is. quantization_config of GPTQ and AWQ (kQuantKeys; compressed-tensors configs
// are not read through that table): each spelling present -> the first spelling of its field that
// the config does not hold, a boolean flipped between a spelling and a negated one. `renamed`
// receives "from->to" for each key renamed.
inline std::string respell_config(const std::string& text, const SpellingTables& t, std::vector<std::string>* renamed) {
  nlohmann::json j = nlohmann::json::parse(text);  // std::map: keys sorted
  auto rename = [&](nlohmann::json& o, const std::string& from, const std::string& to, bool flip, const std::string& prefix) {
    nlohmann::json v = o.at(from);
    if (flip && v.is_boolean()) v = !v.get<bool>();
    o.erase(from);
    o[to] = v;
    renamed->push_back(prefix + from + "->" + to);
  };
  const std::string mt = j.value("model_type", "");
  std::set<std::string> done;
  for (const auto& r : t.model) {
    if (r.model_type != mt || done.count(r.canonical)) continue;
    const bool c = j.contains(r.canonical), a = j.contains(r.alternative);
    if (c && !a) rename(j, r.canonical, r.alternative, false, "");
    else if (a && !c) rename(j, r.alternative, r.canonical, false, "");
    else continue;
    done.insert(r.canonical);
  }
  if (j.contains("quantization_config")) {
    nlohmann::json& q = j["quantization_config"];
    const std::string method = q.value("quant_method", "");
    if (method == "gptq" || method == "awq") {
      std::vector<std::string> fields;
      for (const auto& k : t.quant)
        if (std::find(fields.begin(), fields.end(), k.field) == fields.end()) fields.push_back(k.field);
      for (const auto& f : fields) {
        std::vector<QuantKeySpelling> present, unused;
        for (const auto& k : t.quant)
          if (k.field == f) (q.contains(k.spelling) ? present : unused).push_back(k);
        for (size_t i = 0; i < present.size() && i < unused.size(); ++i)
          rename(q, present[i].spelling, unused[i].spelling, present[i].negated != unused[i].negated, "quantization_config.");
      }
    }
  }
  return j.dump(2) + "\n";
}

}  // namespace wna16::test
