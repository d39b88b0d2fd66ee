#include "server/pipeline/progress.h"

#include <math.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace quantd::pipeline {

std::string FormatDuration(double seconds) {
  const int64_t s = std::max<int64_t>(0, llround(seconds));
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%dh%02dm", s / 3600, (s % 3600) / 60);
}

std::string FormatProgressLine(const ProgressSnapshot& s) {
  std::string line = absl::StrCat(s.stage, "  ", s.tasks_done, "/", s.tasks_total, " tasks");
  if (s.bytes_total == 0) return line;
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

ProgressPrinter::~ProgressPrinter() { EndStage(); }

void ProgressPrinter::BeginStage(const std::string& kind, int64_t tasks_total, int64_t tasks_done,
                                 uint64_t bytes_total, uint64_t bytes_done) {
  EndStage();
  stage_open_ = true;
  stage_ = kind;
  tasks_total_ = tasks_total;
  tasks_done_ = tasks_done;
  bytes_total_ = bytes_total;
  bytes_done_ = bytes_done;
  bytes_done_at_begin_ = bytes_done;
  running_bytes_.store(0, std::memory_order_relaxed);
  begin_ = Clock::now();
  last_draw_ = Clock::time_point();
  if (tty_) Draw();
}

void ProgressPrinter::TaskDone(const std::string& name, uint64_t bytes_total, uint64_t reported) {
  running_bytes_.fetch_sub(reported, std::memory_order_relaxed);
  bytes_done_ += bytes_total;
  ++tasks_done_;
  if (tty_) {
    Tick();
  } else if (out_ != nullptr) {
    *out_ << FormatProgressLine(Snapshot()) << "  done " << name << "\n" << std::flush;
  }
}

void ProgressPrinter::TaskAbandoned(uint64_t reported) {
  running_bytes_.fetch_sub(reported, std::memory_order_relaxed);
}

ProgressSnapshot ProgressPrinter::Snapshot() const {
  ProgressSnapshot s;
  s.stage = stage_;
  s.tasks_done = tasks_done_;
  s.tasks_total = tasks_total_;
  s.bytes_total = bytes_total_;
  const uint64_t running = running_bytes_.load(std::memory_order_relaxed);
  s.bytes_done = std::min(bytes_total_, bytes_done_ + running);
  const uint64_t processed = bytes_done_ - bytes_done_at_begin_ + running;
  const double elapsed = std::chrono::duration<double>(Clock::now() - begin_).count();
  if (processed > 0 && elapsed > 0) s.bytes_per_second = processed / elapsed;
  return s;
}

void ProgressPrinter::Tick() {
  if (!tty_ || !stage_open_) return;
  if (Clock::now() - last_draw_ < std::chrono::milliseconds(kRedrawMs)) return;
  Draw();
}

void ProgressPrinter::Message(const std::string& line) {
  if (out_ == nullptr) return;
  ClearLine();
  *out_ << line << "\n" << std::flush;
}

void ProgressPrinter::EndStage() {
  if (!stage_open_) return;
  if (tty_ && out_ != nullptr) {
    Draw();
    *out_ << "\n" << std::flush;
    line_drawn_ = false;
  }
  stage_open_ = false;
}

void ProgressPrinter::Draw() {
  last_draw_ = Clock::now();
  if (out_ == nullptr) return;
  // \r returns to the start of the line, ESC[K erases what a longer earlier line left.
  *out_ << "\r" << FormatProgressLine(Snapshot()) << "\x1b[K" << std::flush;
  line_drawn_ = true;
}

void ProgressPrinter::ClearLine() {
  if (!line_drawn_) return;
  *out_ << "\r\x1b[K";
  line_drawn_ = false;
}

}  // namespace quantd::pipeline
