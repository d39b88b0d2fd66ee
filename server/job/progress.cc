#include "server/job/progress.h"

#include <math.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace quantd::job {
namespace {

constexpr int kBarWidth = 20;

double Seconds(const google::protobuf::Timestamp& t) { return t.seconds() + t.nanos() * 1e-9; }

bool IsSet(const google::protobuf::Timestamp& t) { return t.seconds() != 0 || t.nanos() != 0; }

// "[#####...............]": bytes done when the stage counts bytes, else tasks done.
std::string Bar(const v1::StageProgress& s) {
  double fraction = 0;
  if (s.state() == v1::StageProgress::SUCCEEDED) {
    fraction = 1;
  } else if (s.bytes_total() > 0) {
    fraction = static_cast<double>(s.bytes_done()) / s.bytes_total();
  } else if (s.tasks_total() > 0) {
    fraction = static_cast<double>(s.tasks_done()) / s.tasks_total();
  }
  const int filled = static_cast<int>(std::clamp(fraction, 0.0, 1.0) * kBarWidth);
  return absl::StrCat("[", std::string(filled, '#'), std::string(kBarWidth - filled, '.'), "]");
}

// A count with the SI prefix `scale` picks (1 k = 1000): "950", "1.2k", "3.0M".
struct CountScale {
  double divisor;
  const char* suffix;
};
CountScale ScaleFor(double count) {
  if (count >= 1e9) return {1e9, "G"};
  if (count >= 1e6) return {1e6, "M"};
  if (count >= 1e3) return {1e3, "k"};
  return {1, ""};
}
std::string FormatCount(double count, CountScale scale) {
  if (scale.divisor == 1) return absl::StrFormat("%.0f", count);
  return absl::StrFormat("%.1f%s", count / scale.divisor, scale.suffix);
}

// "  1.2k/3.0k tokens  4.1k tokens/s" (the rate while running): a stage counting tokens.
std::string TokenCounts(const v1::StageProgress& s, bool running) {
  const CountScale scale = ScaleFor(static_cast<double>(s.bytes_total()));
  std::string out = absl::StrCat("  ", FormatCount(static_cast<double>(s.bytes_done()), scale),
                                 "/", FormatCount(static_cast<double>(s.bytes_total()), scale),
                                 " tokens");
  if (running && s.bytes_per_second() > 0) {
    absl::StrAppend(&out, "  ", FormatCount(s.bytes_per_second(), ScaleFor(s.bytes_per_second())),
                    " tokens/s");
  }
  return out;
}

// "  140.2/805.3 GB  2.31 GB/s" (the rate while running): a stage counting bytes, in GB from
// 1 GB of stage total, else MB.
std::string ByteCounts(const v1::StageProgress& s, bool running) {
  const bool gb = s.bytes_total() >= 1'000'000'000;
  const double unit = gb ? 1e9 : 1e6;
  const char* name = gb ? "GB" : "MB";
  std::string out = absl::StrFormat("  %.1f/%.1f %s", s.bytes_done() / unit,
                                    s.bytes_total() / unit, name);
  if (running && s.bytes_per_second() > 0) {
    absl::StrAppend(&out, absl::StrFormat("  %.2f %s/s", s.bytes_per_second() / unit, name));
  }
  return out;
}

}  // namespace


std::string FormatDuration(double seconds) {
  const int64_t s = std::max<int64_t>(0, llround(seconds));
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%dh%02dm", s / 3600, (s % 3600) / 60);
}

std::string FormatStageLine(const v1::StageProgress& s, StageLineStyle style) {
  std::string line =
      style == StageLineStyle::kBar
          ? absl::StrFormat("%-9s  %s  %d/%d tasks", s.kind(), Bar(s), s.tasks_done(),
                            s.tasks_total())
          : absl::StrFormat("%s  %d/%d tasks", s.kind(), s.tasks_done(), s.tasks_total());
  const bool running = s.state() == v1::StageProgress::RUNNING;
  if (running && !s.step().empty()) absl::StrAppend(&line, "  ", s.step());
  if (s.bytes_total() > 0) {
    // A daemon that sends no unit counts bytes.
    absl::StrAppend(&line, s.unit() == "tokens" ? TokenCounts(s, running) : ByteCounts(s, running));
  }
  if (running && s.has_eta_seconds()) {
    absl::StrAppend(&line, "  ETA ", FormatDuration(s.eta_seconds()));
  }
  if (s.state() == v1::StageProgress::SUCCEEDED) {
    absl::StrAppend(&line, "  done");
    if (IsSet(s.start_time()) && IsSet(s.end_time())) {
      absl::StrAppend(&line, " in ",
                      FormatDuration(Seconds(s.end_time()) - Seconds(s.start_time())));
    }
  } else if (s.state() == v1::StageProgress::FAILED) {
    absl::StrAppend(&line, "  failed");
  }
  return line;
}

ProgressPrinter::ProgressPrinter(std::ostream* out, bool tty) : out_(out), tty_(tty) {}

ProgressPrinter::~ProgressPrinter() { Finish(); }

void ProgressPrinter::Show(const v1::StageProgress& s) {
  const bool new_stage = !shown_ || s.kind() != last_.kind();
  const bool new_task = new_stage || s.tasks_done() != last_.tasks_done();
  if (new_stage) Finish();
  last_ = s;
  shown_ = true;
  if (out_ == nullptr) return;
  if (tty_) {
    if (new_task || Clock::now() - last_draw_ >= std::chrono::milliseconds(kRedrawMs)) Draw();
  } else if (new_task && s.tasks_done() > 0) {
    *out_ << FormatStageLine(s, StageLineStyle::kPlain) << "\n" << std::flush;
  }
}

void ProgressPrinter::Message(const std::string& line) {
  if (out_ == nullptr) return;
  ClearLine();
  *out_ << line << "\n" << std::flush;
}

void ProgressPrinter::Finish() {
  if (!shown_) return;
  if (tty_ && out_ != nullptr) {
    Draw();
    *out_ << "\n" << std::flush;
    line_drawn_ = false;
  }
  shown_ = false;
}

void ProgressPrinter::Draw() {
  last_draw_ = Clock::now();
  if (out_ == nullptr) return;
  // \r returns to the start of the line, ESC[K erases what a longer earlier line left.
  *out_ << "\r" << FormatStageLine(last_, StageLineStyle::kPlain) << "\x1b[K" << std::flush;
  line_drawn_ = true;
}

void ProgressPrinter::ClearLine() {
  if (!line_drawn_) return;
  *out_ << "\r\x1b[K";
  line_drawn_ = false;
}

}  // namespace quantd::job
