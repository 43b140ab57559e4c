// The bench's SVG plot (bench/plot_svg.h): every preset and series named, gaps for NaN and
// non-positive times, XML escaping, errors naming the bad value, an atomic write_svg, and output
// that is well-formed XML (a small checker below; xmllint too where it is installed).
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "bench/plot_svg.h"
#include "test_util.h"
#include "wna16/error.h"

namespace wna16::bench {
namespace {

namespace fs = std::filesystem;
using test::error_of;

bool has(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t i = s.find(what); i != std::string::npos; i = s.find(what, i + 1)) ++n;
  return n;
}

// Six presets as the CUDA bench fills them: wna16 and two baselines, one baseline with a NaN gap.
PlotInput sample() {
  PlotInput in;
  in.title = "wna16 bench --device cuda: int4 gptq g128 sym, bf16";
  in.provenance = "2026-12-02 14:03 UTC, NVIDIA H200, commit 3866c77e";
  in.ceilings = {"read 4543 GB/s", "cuBLAS bf16 797 TFLOP/s"};
  const char* names[] = {"deepseek-v3",   "mixtral-8x7b",     "qwen1.5-moe-a2.7b",
                         "qwen3-30b-a3b", "deepseek-v2-lite", "small"};
  double base = 300;
  for (const char* name : names) {
    PlotPreset p;
    p.name = name;
    p.shape = "E64 k6 H2048 I1408";
    p.series = {{"wna16", {}}, {"per-expert loop", {}}, {"cuBLAS bf16 (dequantised)", {}}};
    for (int64_t m : {1, 4, 16, 64, 256, 1024, 4096, 8192}) {
      const double floor = base * (1 + m / 500.0);
      p.floor.push_back({m, floor});
      p.series[0].points.push_back({m, floor / 0.8});
      p.series[1].points.push_back({m, m == 256 ? NAN : floor * 3});
      p.series[2].points.push_back({m, floor * 5 + 40});
    }
    in.presets.push_back(p);
    base /= 2;
  }
  return in;
}

// "" when s is well-formed XML as far as this plot goes: one root element, tags closed in order,
// quoted attributes without '<' or duplicates, '&' only as an entity, no text outside the root.
std::string xml_problem(const std::string& s) {
  auto entity_at = [&](size_t i) {
    for (const char* e : {"&amp;", "&lt;", "&gt;", "&quot;", "&apos;", "&#"})
      if (s.compare(i, std::strlen(e), e) == 0) return s.find(';', i) != std::string::npos;
    return false;
  };
  auto name_char = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || std::strchr("_:-.", c); };
  std::vector<std::string> open;
  int roots = 0;
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] != '<') {
      if (open.empty() && !std::isspace(static_cast<unsigned char>(s[i]))) return "text outside the root at " + std::to_string(i);
      if (s[i] == '&' && !entity_at(i)) return "bare '&' at " + std::to_string(i);
      ++i;
      continue;
    }
    if (s.compare(i, 2, "<?") == 0 || s.compare(i, 4, "<!--") == 0) {
      const bool pi = s[i + 1] == '?';
      const size_t e = s.find(pi ? "?>" : "-->", i);
      if (e == std::string::npos) return "unterminated " + std::string(pi ? "<?" : "<!--");
      i = e + (pi ? 2 : 3);
      continue;
    }
    const bool closing = s[i + 1] == '/';
    size_t j = i + (closing ? 2 : 1);
    const size_t name_start = j;
    while (j < s.size() && name_char(s[j])) ++j;
    const std::string name = s.substr(name_start, j - name_start);
    if (name.empty()) return "a tag without a name at " + std::to_string(i);
    if (closing) {
      if (open.empty() || open.back() != name) return "</" + name + "> closes " + (open.empty() ? "nothing" : open.back());
      open.pop_back();
      if (j >= s.size() || s[j] != '>') return "junk in </" + name + ">";
      i = j + 1;
      continue;
    }
    std::vector<std::string> attrs;
    for (;;) {
      while (j < s.size() && std::isspace(static_cast<unsigned char>(s[j]))) ++j;
      if (j >= s.size()) return "unterminated <" + name;
      if (s[j] == '>' || s.compare(j, 2, "/>") == 0) break;
      const size_t a = j;
      while (j < s.size() && name_char(s[j])) ++j;
      const std::string attr = s.substr(a, j - a);
      if (attr.empty() || j + 1 >= s.size() || s[j] != '=' || (s[j + 1] != '"' && s[j + 1] != '\''))
        return "bad attribute in <" + name + "> at " + std::to_string(a);
      for (const auto& prev : attrs)
        if (prev == attr) return "duplicate attribute " + attr + " in <" + name + ">";
      attrs.push_back(attr);
      const char q = s[j + 1];
      const size_t end = s.find(q, j + 2);
      if (end == std::string::npos) return "unterminated value of " + attr;
      for (size_t k = j + 2; k < end; ++k)
        if (s[k] == '<' || (s[k] == '&' && !entity_at(k))) return "bad character in the value of " + attr;
      j = end + 1;
    }
    if (open.empty() && roots++ > 0) return "a second root element <" + name + ">";
    if (s[j] == '>') open.push_back(name);
    i = j + (s[j] == '>' ? 1 : 2);
  }
  if (!open.empty()) return "<" + open.back() + "> is never closed";
  return roots == 1 ? "" : "no root element";
}

TEST(PlotSvg, XmlCheckerCatchesBrokenDocuments) {
  EXPECT_EQ(xml_problem("<?xml version=\"1.0\"?>\n<svg a=\"1\"><g><text>x &amp; y</text></g><rect/></svg>\n"), "");
  EXPECT_NE(xml_problem("<svg><g></svg>"), "");
  EXPECT_NE(xml_problem("<svg>a & b</svg>"), "");
  EXPECT_NE(xml_problem("<svg a=\"<\"/>"), "");
  EXPECT_NE(xml_problem("<svg a=\"1\" a=\"2\"/>"), "");
  EXPECT_NE(xml_problem("<svg/><svg/>"), "");
  EXPECT_NE(xml_problem("<svg>"), "");
}

TEST(PlotSvg, StandaloneWellFormedSvg) {
  const std::string svg = render_svg(sample());
  EXPECT_EQ(xml_problem(svg), "");
  EXPECT_EQ(svg.rfind("<?xml version=\"1.0\" encoding=\"UTF-8\"", 0), 0u);
  EXPECT_TRUE(has(svg, "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"")) << svg.substr(0, 300);
  EXPECT_TRUE(has(svg, "viewBox=\"0 0 "));
  EXPECT_TRUE(has(svg, "font-family=\"sans-serif\""));
  for (const char* banned : {"<script", "href", "url(", "@import", "<image", "<foreignObject"})
    EXPECT_FALSE(has(svg, banned)) << banned;
}

TEST(PlotSvg, NamesEveryPresetSeriesAndTheHeader) {
  const PlotInput in = sample();
  const std::string svg = render_svg(in);
  for (const auto& p : in.presets) {
    EXPECT_TRUE(has(svg, ">" + p.name + "</text>")) << p.name;
    for (const auto& s : p.series) EXPECT_TRUE(has(svg, ">" + s.name + "</text>")) << s.name;  // the legend
  }
  EXPECT_TRUE(has(svg, in.title));
  EXPECT_TRUE(has(svg, in.provenance));
  for (const auto& c : in.ceilings) EXPECT_TRUE(has(svg, c)) << c;
  EXPECT_TRUE(has(svg, "roofline floor"));
  EXPECT_TRUE(has(svg, "stroke-dasharray"));
  // The legend lists a series once however many presets it appears in.
  EXPECT_EQ(count(svg, ">per-expert loop</text>"), 1u);
  EXPECT_EQ(xml_problem(svg), "");
}

TEST(PlotSvg, PercentOfRooflinePerPoint) {
  PlotInput in;
  in.title = "t";
  in.presets = {{"p", "s", {{"wna16", {{1, 100}, {8, 40}, {64, 1000}}}}, {{1, 50}, {8, 30}, {64, 250}}}};
  const std::string svg = render_svg(in);
  EXPECT_TRUE(has(svg, ">50%</text>"));
  EXPECT_TRUE(has(svg, ">75%</text>"));
  EXPECT_TRUE(has(svg, ">25%</text>"));
  EXPECT_TRUE(has(svg, ">100%</text>"));  // the strip's scale
}

TEST(PlotSvg, NanAndNonPositiveTimesAreGaps) {
  PlotInput in;
  in.title = "gaps";
  PlotPreset p{"gappy", "E8 k2", {{"wna16", {}}}, {}};
  // Valid at 1, 2, 16, 32; invalid at 4 (NaN), 8 (zero), 64 (negative), 128 (inf).
  p.series[0].points = {{1, 10}, {2, 12}, {4, NAN}, {8, 0}, {16, 30}, {32, 50}, {64, -5}, {128, INFINITY}};
  p.floor = {{1, 5}, {2, 6}, {4, 7}, {8, 8}, {16, 9}, {32, 10}, {64, 11}, {128, NAN}};
  in.presets = {p};
  const std::string svg = render_svg(in);
  EXPECT_EQ(xml_problem(svg), "");
  for (const char* bad : {"nan", "NaN", "inf"}) EXPECT_FALSE(has(svg, bad)) << bad;
  for (int m : {1, 2, 16, 32}) EXPECT_TRUE(has(svg, "wna16, M=" + std::to_string(m) + ":")) << m;
  for (int m : {4, 8, 64, 128}) EXPECT_FALSE(has(svg, "wna16, M=" + std::to_string(m) + ":")) << m;
  // Two runs of series[0] (1-2 and 16-32), each its own bold polyline; no % bar for a gap.
  EXPECT_EQ(count(svg, "stroke-width=\"2.8\" stroke-linejoin"), 2u);
  for (int m : {4, 8, 64, 128}) EXPECT_FALSE(has(svg, "M=" + std::to_string(m) + ": ")) << m;
}

TEST(PlotSvg, PresetWithoutValidPointsSaysNoData) {
  PlotInput in = sample();
  in.presets[2].series = {{"wna16", {{1, NAN}, {4, 0}, {16, -1}}}, {"per-expert loop", {{1, NAN}}}};
  in.presets[4].series.clear();
  const std::string svg = render_svg(in);
  EXPECT_EQ(count(svg, ">no data</text>"), 2u);
  EXPECT_TRUE(has(svg, ">" + in.presets[2].name + "</text>"));
  EXPECT_TRUE(has(svg, ">" + in.presets[4].name + "</text>"));
  EXPECT_EQ(xml_problem(svg), "");
}

TEST(PlotSvg, EscapesXmlSpecialCharactersInAllText) {
  PlotInput in;
  in.title = "a<b & \"c\" 'd'>";
  in.provenance = "prov <&>";
  in.ceilings = {"read <1> & 'x'"};
  in.presets = {{"pre<set>&", "E8 \"k2\" 'x'", {{"s<0>&\"'", {{1, 10}, {2, 20}}}, {"base&line", {{1, 30}}}},
                 {{1, 5}, {2, 6}}}};
  const std::string svg = render_svg(in);
  EXPECT_EQ(xml_problem(svg), "");
  for (const char* raw : {"a<b", "pre<set>&", "s<0>", "base&line", "read <1>", "prov <&>", "\"k2\""})
    EXPECT_FALSE(has(svg, raw)) << raw;
  for (const char* escaped : {"a&lt;b &amp; &quot;c&quot; &apos;d&apos;&gt;", "pre&lt;set&gt;&amp;",
                              "s&lt;0&gt;&amp;&quot;&apos;", "base&amp;line", "read &lt;1&gt; &amp; &apos;x&apos;",
                              "prov &lt;&amp;&gt;", "E8 &quot;k2&quot; &apos;x&apos;"})
    EXPECT_TRUE(has(svg, escaped)) << escaped;
  // Control characters XML 1.0 does not allow never reach the document.
  in.title = std::string("bell\x07") + "esc\x1b";
  EXPECT_EQ(xml_problem(render_svg(in)), "");
  EXPECT_FALSE(has(render_svg(in), "\x07"));
}

TEST(PlotSvg, ErrorsNameTheBadValue) {
  EXPECT_TRUE(has(error_of([] { render_svg(PlotInput{}); }), "presets.size()=0"));
  PlotInput in = sample();
  in.presets[1].series[2].points[3].M = 0;
  const std::string e0 = error_of([&] { render_svg(in); });
  EXPECT_TRUE(has(e0, "M=0")) << e0;
  EXPECT_TRUE(has(e0, "mixtral-8x7b")) << e0;
  EXPECT_TRUE(has(e0, "cuBLAS bf16 (dequantised)")) << e0;
  in = sample();
  in.presets[5].floor[0].M = -16;
  const std::string e1 = error_of([&] { render_svg(in); });
  EXPECT_TRUE(has(e1, "M=-16")) << e1;
  EXPECT_TRUE(has(e1, "floor")) << e1;
}

class PlotSvgFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("wna16_plot_svg_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  static std::string read(const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  fs::path dir_;
};

TEST_F(PlotSvgFile, WritesTheRenderedDocumentAndNoTemporary) {
  const PlotInput in = sample();
  const fs::path out = dir_ / "plot.svg";
  std::ofstream(out) << "an older plot";  // replaced whole
  write_svg(in, out.string());
  EXPECT_EQ(read(out), render_svg(in));
  EXPECT_FALSE(fs::exists(out.string() + ".tmp"));
}

TEST_F(PlotSvgFile, UnwritablePathThrowsNamingItAndLeavesNothing) {
  const fs::path missing = dir_ / "no-such-dir" / "plot.svg";
  const std::string e = error_of([&] { write_svg(sample(), missing.string()); });
  EXPECT_TRUE(has(e, missing.string())) << e;
  EXPECT_FALSE(fs::exists(missing));
  EXPECT_FALSE(fs::exists(missing.string() + ".tmp"));
  // A directory in the way: the temporary is written, the rename fails, the temporary goes.
  const fs::path taken = dir_ / "taken.svg";
  fs::create_directories(taken / "inside");
  const std::string e2 = error_of([&] { write_svg(sample(), taken.string()); });
  EXPECT_TRUE(has(e2, taken.string())) << e2;
  EXPECT_TRUE(fs::is_directory(taken / "inside"));
  EXPECT_FALSE(fs::exists(taken.string() + ".tmp"));
  // A bad input throws before any file is made.
  const std::string e3 = error_of([&] { write_svg(PlotInput{}, (dir_ / "empty.svg").string()); });
  EXPECT_TRUE(has(e3, "presets")) << e3;
  EXPECT_FALSE(fs::exists(dir_ / "empty.svg"));
  EXPECT_FALSE(fs::exists(dir_ / "empty.svg.tmp"));
}

TEST_F(PlotSvgFile, XmllintAcceptsItWhereInstalled) {
  if (std::system("command -v xmllint >/dev/null 2>&1") != 0) GTEST_SKIP() << "xmllint not installed";
  PlotInput in = sample();
  in.title = "<&>\"' escaped";
  in.presets[3].series[0].points[2].us = NAN;
  const fs::path out = dir_ / "lint.svg";
  write_svg(in, out.string());
  EXPECT_EQ(std::system(("xmllint --noout '" + out.string() + "'").c_str()), 0);
}

// WNA16_PLOT_SAMPLE=FILE.svg writes the sample above, to look at it: scripts/svg-screenshot FILE.svg FILE.png
TEST(PlotSvgSample, WritesTheSampleWhereAsked) {
  const char* path = std::getenv("WNA16_PLOT_SAMPLE");
  if (!path || !*path) GTEST_SKIP() << "set WNA16_PLOT_SAMPLE=FILE.svg to write the sample plot";
  write_svg(sample(), path);
}

}  // namespace
}  // namespace wna16::bench
