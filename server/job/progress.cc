#include "server/job/progress.h"

#include <math.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace quantd::job {

std::string FormatDuration(double seconds) {
  const int64_t s = std::max<int64_t>(0, llround(seconds));
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%dh%02dm", s / 3600, (s % 3600) / 60);
}

std::string FormatProgressLine(const ProgressSnapshot& s) {
  std::string line = absl::StrCat(s.stage, "  ", s.tasks_done, "/", s.tasks_total, " tasks");
  if (s.bytes_total == 0) return line;
  if (s.stage == "calibrate" || s.stage == "evaluate") {
    // The calibrate and evaluate stages count tokens, not bytes (pipeline/stages/).
    absl::StrAppend(&line, absl::StrFormat("  %d/%d tokens", s.bytes_done, s.bytes_total));
    if (!s.bytes_per_second.has_value()) return line;
    absl::StrAppend(&line, absl::StrFormat("  %.0f tokens/s", *s.bytes_per_second));
    if (*s.bytes_per_second > 0 && s.bytes_done < s.bytes_total) {
      absl::StrAppend(&line, "  ETA ",
                      FormatDuration((s.bytes_total - s.bytes_done) / *s.bytes_per_second));
    }
    return line;
  }
  const bool gb = s.bytes_total >= 1'000'000'000;
  const double unit = gb ? 1e9 : 1e6;
  const char* name = gb ? "GB" : "MB";
  absl::StrAppend(
      &line, absl::StrFormat("  %.1f/%.1f %s", s.bytes_done / unit, s.bytes_total / unit, name));
  if (!s.bytes_per_second.has_value()) return line;
  absl::StrAppend(&line, absl::StrFormat("  %.2f %s/s", *s.bytes_per_second / unit, name));
  if (*s.bytes_per_second > 0 && s.bytes_done < s.bytes_total) {
    absl::StrAppend(&line, "  ETA ",
                    FormatDuration((s.bytes_total - s.bytes_done) / *s.bytes_per_second));
  }
  return line;
}

ProgressPrinter::ProgressPrinter(std::ostream* out, bool tty) : out_(out), tty_(tty) {}

ProgressPrinter::~ProgressPrinter() { Finish(); }

void ProgressPrinter::Show(const ProgressSnapshot& s) {
  const bool new_stage = !shown_ || s.stage != last_.stage;
  const bool new_task = new_stage || s.tasks_done != last_.tasks_done;
  if (new_stage) Finish();
  last_ = s;
  shown_ = true;
  if (out_ == nullptr) return;
  if (tty_) {
    if (new_task || Clock::now() - last_draw_ >= std::chrono::milliseconds(kRedrawMs)) Draw();
  } else if (new_task && s.tasks_done > 0) {
    *out_ << FormatProgressLine(s) << "\n" << std::flush;
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
  *out_ << "\r" << FormatProgressLine(last_) << "\x1b[K" << std::flush;
  line_drawn_ = true;
}

void ProgressPrinter::ClearLine() {
  if (!line_drawn_) return;
  *out_ << "\r\x1b[K";
  line_drawn_ = false;
}

}  // namespace quantd::job
