// The bench's SVG plot (see plot_svg.h): a header (title, provenance, ceilings, legend) over a grid
// of panels, one per preset. Each panel has a log2 M axis shared by two plots: the time per call
// on a log10 microsecond axis (roofline floor dashed, series[0] bold with markers, baselines
// thinner), and beneath it a 0-100% strip with one labelled bar per M: floor / us of series[0].
// Points with a NaN or non-positive time are gaps; nothing is ever drawn at 0.
#include "plot_svg.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "wna16/error.h"

namespace wna16::bench {
namespace {

// Page and panel geometry, in px. Panel coordinates are relative to the panel's top-left corner.
constexpr double kMargin = 20, kPanelW = 490, kPanelH = 400;
constexpr double kPlotL = 70, kPlotR = 472, kPlotT = 50, kPlotB = 268;  // the time plot
constexpr double kStripT = 280, kStrip100 = 294, kStripB = 338;         // the % strip (0% at B)
constexpr double kXLabelY = 353, kXTitleY = 372;

// series[0]'s blue first, then the baselines' colours (Okabe-Ito-like, readable on white).
constexpr const char* kPalette[] = {"#1f5fbf", "#e07b00", "#2e9e44", "#c8373a",
                                    "#8a4fbf", "#6e6e6e", "#1a9fb0", "#a8862a"};
constexpr int kBaselineColours = 7;
constexpr const char* kFloorColour = "#222222";

bool valid(const PlotPoint& p) { return std::isfinite(p.us) && p.us > 0; }

// Text as XML character data or attribute value; control characters XML 1.0 forbids become '?'.
std::string esc(std::string_view s) {
  std::string o;
  o.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      case '\'': o += "&apos;"; break;
      default:
        const auto u = static_cast<unsigned char>(c);
        o += (u < 0x20 && c != '\t' && c != '\n' && c != '\r') ? '?' : c;
    }
  }
  return o;
}

// Rough width of sans-serif text (DejaVu/Liberation-like metrics; UTF-8 continuation bytes skipped).
double text_w(std::string_view s, double size) {
  double em = 0;
  for (char c : s) {
    if ((c & 0xC0) == 0x80) continue;
    if (c >= '0' && c <= '9') em += 0.64;
    else if (c == '%' || c == 'm' || c == 'w' || c == 'M' || c == 'W') em += 0.95;
    else if (c >= 'A' && c <= 'Z') em += 0.7;
    else if (std::strchr(" .,:;'|!()[]iljtf", c)) em += 0.32;
    else em += 0.56;
  }
  return em * size;
}

// A <text> element; squeezed to max_w (when given) if the estimate says it would not fit.
void text(std::string& o, double x, double y, std::string_view s, double size, std::string_view attrs = "",
          std::string_view anchor = "start", double max_w = 0) {
  std::string fit;
  if (max_w > 0 && text_w(s, size) > max_w) fit = fmt::format(" textLength=\"{:.0f}\" lengthAdjust=\"spacingAndGlyphs\"", max_w);
  o += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"{}\" text-anchor=\"{}\"{} {}>{}</text>\n", x, y, size,
                   anchor, fit, attrs, esc(s));
}

// Marker shapes: 0 circle (series[0]), 1 square, 2 triangle, 3 diamond. `tip` becomes a tooltip.
void marker(std::string& o, int shape, double x, double y, double r, const std::string& colour,
            const std::string& tip) {
  const std::string t = "<title>" + esc(tip) + "</title>";
  const std::string paint = fmt::format("fill=\"{}\" stroke=\"#ffffff\" stroke-width=\"0.8\"", colour);
  switch (shape) {
    case 0: o += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"{}\" {}>{}</circle>\n", x, y, r, paint, t); break;
    case 1:
      o += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" {}>{}</rect>\n", x - r, y - r,
                       2 * r, 2 * r, paint, t);
      break;
    case 2:
      o += fmt::format("<path d=\"M{:.1f},{:.1f}L{:.1f},{:.1f}L{:.1f},{:.1f}Z\" {}>{}</path>\n", x, y - 1.2 * r,
                       x + 1.1 * r, y + 0.8 * r, x - 1.1 * r, y + 0.8 * r, paint, t);
      break;
    default:
      o += fmt::format("<path d=\"M{:.1f},{:.1f}L{:.1f},{:.1f}L{:.1f},{:.1f}L{:.1f},{:.1f}Z\" {}>{}</path>\n", x,
                       y - 1.3 * r, x + 1.3 * r, y, x, y + 1.3 * r, x - 1.3 * r, y, paint, t);
  }
}

struct Style {
  std::string colour;
  int shape = 0;
  bool primary = false;  // series[0] of some preset: bold line
};

// One style per series name, in order of first appearance over the presets.
std::vector<std::pair<std::string, Style>> series_styles(const PlotInput& in) {
  std::vector<std::pair<std::string, Style>> styles;
  for (const auto& p : in.presets)
    for (size_t i = 0; i < p.series.size(); ++i) {
      const auto& name = p.series[i].name;
      auto it = std::find_if(styles.begin(), styles.end(), [&](const auto& s) { return s.first == name; });
      if (it == styles.end()) {
        const int k = static_cast<int>(styles.size());
        Style s;
        s.colour = kPalette[k == 0 ? 0 : 1 + (k - 1) % kBaselineColours];
        s.shape = k == 0 ? 0 : 1 + (k - 1) % 3;
        styles.emplace_back(name, s);
        it = styles.end() - 1;
      }
      if (i == 0) it->second.primary = true;
    }
  return styles;
}

const Style& style_of(const std::vector<std::pair<std::string, Style>>& styles, const std::string& name) {
  return std::find_if(styles.begin(), styles.end(), [&](const auto& s) { return s.first == name; })->second;
}

std::string us_label(double us) {
  if (us >= 1e6) return fmt::format("{:g} s", us / 1e6);
  if (us >= 1e3) return fmt::format("{:g} ms", us / 1e3);
  return fmt::format("{:g} \u00b5s", us);
}

std::string pct_label(double pct) { return pct < 1 ? fmt::format("{:.1f}%", pct) : fmt::format("{:.0f}%", pct); }

void validate(const PlotInput& in) {
  if (in.presets.empty()) throw Error("plot: PlotInput has no presets (presets.size()=0), nothing to draw");
  for (const auto& p : in.presets) {
    auto check = [&](const std::vector<PlotPoint>& pts, const std::string& what) {
      for (const auto& pt : pts)
        if (pt.M <= 0)
          throw Error(fmt::format("plot: M={} in preset '{}' ({}) is not positive", pt.M, p.name, what));
    };
    for (const auto& s : p.series) check(s.points, "series '" + s.name + "'");
    check(p.floor, "floor");
  }
}

class Panel {
 public:
  Panel(std::string& o, const PlotPreset& p, double ox, double oy) : o_(o), p_(p), ox_(ox), oy_(oy) {}

  void draw(const std::vector<std::pair<std::string, Style>>& styles) {
    o_ += fmt::format("<g transform=\"translate({:.0f},{:.0f})\">\n", ox_, oy_);
    o_ += fmt::format("<rect x=\"0.5\" y=\"0.5\" width=\"{}\" height=\"{}\" fill=\"#ffffff\" stroke=\"#d0d0d0\"/>\n",
                      kPanelW - 11, kPanelH - 11);
    text(o_, 12, 20, p_.name, 15, "font-weight=\"bold\" fill=\"#111111\"", "start", kPanelW - 35);
    text(o_, 12, 37, p_.shape, 11.5, "fill=\"#555555\"", "start", kPanelW - 35);
    if (!find_domain()) {
      o_ += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"#f6f6f6\" stroke=\"#bbbbbb\"/>\n",
                        kPlotL, kPlotT, kPlotR - kPlotL, kStripB - kPlotT);
      text(o_, (kPlotL + kPlotR) / 2, (kPlotT + kStripB) / 2, "no data", 16, "fill=\"#888888\"", "middle");
      o_ += "</g>\n";
      return;
    }
    axes();
    draw_line(p_.floor, kFloorColour, 1.6, "stroke-dasharray=\"7 4\"", -1, "roofline floor");
    const size_t n = p_.series.size();
    for (size_t k = 1; k <= n; ++k) {  // the baselines, then series[0] on top of them
      const auto& s = p_.series[k % n];
      const Style& st = style_of(styles, s.name);
      draw_line(s.points, st.colour, k == n ? 2.8 : 1.5, "", st.shape, s.name, k == n ? 4.2 : 3.0);
    }
    strip(style_of(styles, p_.series[0].name).colour);
    o_ += "</g>\n";
  }

 private:
  std::string& o_;
  const PlotPreset& p_;
  double ox_, oy_;
  double xlo_ = 0, xhi_ = 1, ylo_ = 0, yhi_ = 1;  // log2 M and log10 us at the plot edges
  std::vector<int64_t> ms_;                      // the M values of valid points, sorted, unique

  double x(int64_t m) const { return kPlotL + (std::log2(double(m)) - xlo_) / (xhi_ - xlo_) * (kPlotR - kPlotL); }
  double y(double us) const { return kPlotB - (std::log10(us) - ylo_) / (yhi_ - ylo_) * (kPlotB - kPlotT); }

  // False when no series has a valid point ("no data").
  bool find_domain() {
    double lo = INFINITY, hi = 0;
    auto scan = [&](const std::vector<PlotPoint>& pts) {
      for (const auto& pt : pts)
        if (valid(pt)) lo = std::min(lo, pt.us), hi = std::max(hi, pt.us), ms_.push_back(pt.M);
    };
    for (const auto& s : p_.series) scan(s.points);
    if (ms_.empty()) return false;
    scan(p_.floor);
    std::sort(ms_.begin(), ms_.end());
    ms_.erase(std::unique(ms_.begin(), ms_.end()), ms_.end());
    const double pad = ms_.size() > 1 ? 0.04 * std::log2(double(ms_.back()) / double(ms_.front())) + 0.3 : 1.0;
    xlo_ = std::log2(double(ms_.front())) - pad;
    xhi_ = std::log2(double(ms_.back())) + pad;
    ylo_ = std::floor(std::log10(lo) - 0.02);
    yhi_ = std::max(std::ceil(std::log10(hi) + 0.02), ylo_ + 1);
    return true;
  }

  void line(double x0, double y0, double x1, double y1, const char* colour) {
    o_ += fmt::format("<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"{}\"/>\n", x0, y0, x1, y1, colour);
  }
  void hline(double x0, double x1, double yy, const char* colour) { line(x0, yy, x1, yy, colour); }

  void axes() {
    // y: decade gridlines and labels (at most 7 labelled), minor ticks at 2..9 x decade up to 8
    // decades; with at most two decades the 2x and 5x ticks are labelled too.
    const int d0 = int(ylo_), d1 = int(yhi_), step = (d1 - d0 + 5) / 6;
    for (int d = d0; d <= d1; ++d) {
      const double yy = y(std::pow(10.0, d));
      hline(kPlotL, kPlotR, yy, "#dddddd");
      if ((d - d0) % step == 0) text(o_, kPlotL - 6, yy + 4, us_label(std::pow(10.0, d)), 11, "fill=\"#333333\"", "end");
      for (int k = 2; k <= 9 && d < d1 && d1 - d0 <= 8; ++k) {
        const double v = k * std::pow(10.0, d), yk = y(v);
        hline(kPlotL, kPlotL + 4, yk, "#888888");
        if (d1 - d0 <= 2 && (k == 2 || k == 5)) {
          hline(kPlotL + 4, kPlotR, yk, "#f0f0f0");
          text(o_, kPlotL - 6, yk + 4, us_label(v), 10, "fill=\"#777777\"", "end");
        }
      }
    }
    o_ += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#888888\"/>\n", kPlotL,
                      kPlotT, kPlotR - kPlotL, kPlotB - kPlotT);
    o_ += fmt::format("<text transform=\"translate(16,{:.1f}) rotate(-90)\" font-size=\"11\" text-anchor=\"middle\" "
                      "fill=\"#444444\">time per call (log)</text>\n",
                      (kPlotT + kPlotB) / 2);
    // x: the measured M values (powers of 4 when there are too many), labels that would overlap skipped.
    std::vector<int64_t> ticks = ms_;
    if (ticks.size() > 14) {
      ticks.clear();
      for (int64_t m = 1;; m *= 4) {
        if (m >= ms_.front() && m <= ms_.back()) ticks.push_back(m);
        if (m > ms_.back() / 4) break;
      }
      if (ticks.size() < 2) ticks = ms_;  // no two powers of 4 in range: overlapping labels are skipped
    }
    double last_right = -1e9;
    bool kilo = false;  // a label in units of 1024
    for (int64_t m : ticks) {
      const double xx = x(m);
      line(xx, kPlotT, xx, kPlotB, "#eeeeee");
      line(xx, kPlotB - 4, xx, kPlotB, "#888888");
      line(xx, kStripB, xx, kStripB + 4, "#888888");
      const std::string s = m >= 1024 && m % 1024 == 0 ? fmt::format("{}k", m / 1024) : fmt::format("{}", m);
      kilo = kilo || (m >= 1024 && m % 1024 == 0);
      const double half = text_w(s, 10.5) / 2;
      if (xx - half < last_right + 4) continue;
      text(o_, xx, kXLabelY, s, 10.5, "fill=\"#333333\"", "middle");
      last_right = xx + half;
    }
    text(o_, (kPlotL + kPlotR) / 2, kXTitleY, kilo ? "M (tokens per call, log2; 1k = 1024)" : "M (tokens per call, log2)",
         11, "fill=\"#444444\"", "middle");
  }

  // A polyline through the valid points in M order, broken where a point is invalid (a gap).
  void draw_line(const std::vector<PlotPoint>& pts, const std::string& colour, double w, std::string_view extra, int shape,
                 const std::string& name, double r = 0) {
    std::vector<PlotPoint> sorted = pts;
    std::stable_sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.M < b.M; });
    std::vector<std::vector<std::pair<double, double>>> segs(1);  // runs of valid points, in px
    for (const auto& pt : sorted) {
      if (valid(pt)) segs.back().emplace_back(x(pt.M), y(pt.us));
      else if (!segs.back().empty()) segs.emplace_back();
    }
    for (auto& seg : segs) {
      if (seg.size() == 1 && shape < 0)  // a lone point of a line without markers: a short dash
        seg = {{seg[0].first - 9, seg[0].second}, {seg[0].first + 9, seg[0].second}};
      if (seg.size() < 2) continue;
      std::string pts_attr;
      for (const auto& [px, py] : seg) pts_attr += fmt::format("{}{:.1f},{:.1f}", pts_attr.empty() ? "" : " ", px, py);
      o_ += fmt::format("<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"{}\" "
                        "stroke-linejoin=\"round\" {}/>\n",
                        pts_attr, colour, w, extra);
    }
    if (shape < 0) return;
    for (const auto& pt : sorted)
      if (valid(pt)) marker(o_, shape, x(pt.M), y(pt.us), r, colour, fmt::format("{}, M={}: {:.4g} \u00b5s", name, pt.M, pt.us));
  }

  // series[0]'s % of the roofline per M: a bar (clamped at 100%) and its value above it.
  void strip(const std::string& colour) {
    o_ += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"#fafafa\" stroke=\"#888888\"/>\n", kPlotL,
                      kStripT, kPlotR - kPlotL, kStripB - kStripT);
    for (int pct : {0, 50, 100}) {
      const double yy = kStripB - pct / 100.0 * (kStripB - kStrip100);
      if (pct) hline(kPlotL, kPlotR, yy, "#e2e2e2");
      text(o_, kPlotL - 6, yy + 3.5, fmt::format("{}%", pct), 9.5, "fill=\"#555555\"", "end");
    }
    o_ += fmt::format("<text transform=\"translate(16,{:.1f}) rotate(-90)\" font-size=\"9.5\" text-anchor=\"middle\" "
                      "fill=\"#444444\">of roofline</text>\n",
                      (kStripT + kStripB) / 2);
    double gap = kPlotR - kPlotL;  // the bar width follows the closest pair of M values
    for (size_t i = 1; i < ms_.size(); ++i) gap = std::min(gap, x(ms_[i]) - x(ms_[i - 1]));
    const double bw = std::clamp(0.5 * gap, 3.0, 18.0);
    std::map<int64_t, double> floor_us;
    for (const auto& f : p_.floor)
      if (valid(f)) floor_us[f.M] = f.us;
    std::vector<PlotPoint> pts = p_.series[0].points;
    std::stable_sort(pts.begin(), pts.end(), [](const auto& a, const auto& b) { return a.M < b.M; });
    double last_right = -1e9;
    for (const auto& pt : pts) {
      const auto f = floor_us.find(pt.M);
      if (!valid(pt) || f == floor_us.end()) continue;
      const double pct = f->second / pt.us * 100, xx = x(pt.M);
      const double top = kStripB - std::min(pct, 100.0) / 100 * (kStripB - kStrip100);
      o_ += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"{}\" "
                        "fill-opacity=\"0.45\"><title>{}</title></rect>\n",
                        xx - bw / 2, top, bw, kStripB - top, colour,
                        esc(fmt::format("M={}: {:.1f}% of the roofline ({:.4g} \u00b5s floor, {:.4g} \u00b5s)", pt.M, pct,
                                        f->second, pt.us)));
      const std::string s = pct_label(pct);
      const double half = text_w(s, 9.5) / 2;
      if (xx - half < last_right + 2) continue;
      text(o_, xx, top - 2.5, s, 9.5, "fill=\"#1a3f7a\"", "middle");
      last_right = xx + half;
    }
  }
};

}  // namespace

std::string render_svg(const PlotInput& in) {
  validate(in);
  const auto styles = series_styles(in);
  const int n = static_cast<int>(in.presets.size());
  const int cols = n == 1 ? 1 : n <= 4 ? 2 : 3, rows = (n + cols - 1) / cols;
  const double W = 2 * kMargin + cols * kPanelW, inner = W - 2 * kMargin;

  std::string head;
  double yy = 32;
  text(head, kMargin, yy, in.title, 20, "font-weight=\"bold\" fill=\"#111111\"", "start", inner);
  if (!in.provenance.empty()) text(head, kMargin, yy += 20, in.provenance, 12.5, "fill=\"#555555\"", "start", inner);
  if (!in.ceilings.empty()) {
    std::string c = "ceilings: ";
    for (size_t i = 0; i < in.ceilings.size(); ++i) c += (i ? "  \u00b7  " : "") + in.ceilings[i];
    text(head, kMargin, yy += 18, c, 12.5, "fill=\"#555555\"", "start", inner);
  }
  // Legend: the series (union over presets), the roofline, the % bars; wrapped into rows.
  yy += 26;
  double lx = kMargin;
  auto item = [&](const std::string& label, auto&& swatch) {
    const double w = 34 + text_w(label, 12) + 24;
    if (lx > kMargin && lx + w > W - kMargin) lx = kMargin, yy += 22;
    swatch(lx, yy - 4);
    text(head, lx + 34, yy, label, 12, "fill=\"#222222\"");
    lx += w;
  };
  for (const auto& named : styles)
    item(named.first, [&](double x, double y) {
      const Style& st = named.second;
      head += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{}\" stroke-width=\"{}\"/>\n", x, y,
                          x + 26, y, st.colour, st.primary ? 2.8 : 1.5);
      marker(head, st.shape, x + 13, y, st.primary ? 4.2 : 3.0, st.colour, named.first);
    });
  item("roofline floor", [&](double x, double y) {
    head += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{}\" stroke-width=\"1.6\" "
                        "stroke-dasharray=\"7 4\"/>\n",
                        x, y, x + 26, y, kFloorColour);
  });
  const auto first = std::find_if(in.presets.begin(), in.presets.end(), [](const auto& p) { return !p.series.empty(); });
  if (first != in.presets.end())
    item("bars: % of the roofline reached by " + first->series[0].name, [&](double x, double y) {
      head += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"10\" height=\"12\" fill=\"{}\" fill-opacity=\"0.45\"/>\n", x + 8,
                          y - 6, style_of(styles, first->series[0].name).colour);
    });
  const double top = yy + 16, H = top + rows * kPanelH + kMargin / 2;

  std::string o = fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\" standalone=\"yes\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"{0:.0f}\" height=\"{1:.0f}\" "
      "viewBox=\"0 0 {0:.0f} {1:.0f}\" font-family=\"sans-serif\">\n"
      "<title>{2}</title>\n<rect x=\"0\" y=\"0\" width=\"{0:.0f}\" height=\"{1:.0f}\" fill=\"#ffffff\"/>\n",
      W, H, esc(in.title));
  o += head;
  for (int i = 0; i < n; ++i)
    Panel(o, in.presets[i], kMargin + (i % cols) * kPanelW, top + (i / cols) * kPanelH).draw(styles);
  o += "</svg>\n";
  return o;
}

void write_svg(const PlotInput& in, const std::string& path) {
  const std::string svg = render_svg(in);  // a bad input throws before any file is touched
  if (path.empty()) throw Error("plot: the output path is empty");
  const std::string tmp = path + ".tmp";
  auto fail = [&](const char* step, int err, bool remove_tmp) {
    if (remove_tmp) std::remove(tmp.c_str());
    throw Error(fmt::format("plot: cannot write '{}' ({} '{}': {})", path, step, tmp, std::strerror(err)));
  };
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) fail("opening", errno, false);
  const bool wrote = std::fwrite(svg.data(), 1, svg.size(), f) == svg.size();
  int err = errno;
  const bool closed = std::fclose(f) == 0;
  if (!closed && wrote) err = errno;
  if (!wrote || !closed) fail("writing", err ? err : EIO, true);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) fail("renaming into place from", errno, true);
}

}  // namespace wna16::bench
