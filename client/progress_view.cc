#include "client/progress_view.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/job/progress.h"

namespace quantd::client {
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

// What a plain (non-TTY) stage line is reprinted for.
std::string StageChangeKey(const v1::StageProgress& s) {
  return absl::StrCat(s.state(), " ", s.tasks_done(), "/", s.tasks_total());
}

}  // namespace

std::string FormatJobHeader(const v1::Job& job) {
  std::string line = absl::StrCat("job ", job.id(), " ", v1::JobState_Name(job.state()));
  if (!job.reason().empty()) absl::StrAppend(&line, " (", job.reason(), ")");
  if (job.task_retries() > 0) absl::StrAppend(&line, "  retries ", job.task_retries());
  return line;
}

std::string FormatStageLine(const v1::StageProgress& s) {
  std::string line =
      absl::StrFormat("%-9s  %s  %d/%d tasks", s.kind(), Bar(s), s.tasks_done(), s.tasks_total());
  const bool running = s.state() == v1::StageProgress::RUNNING;
  if (running && !s.step().empty()) absl::StrAppend(&line, "  ", s.step());
  if (s.bytes_total() > 0) {
    // A daemon that sends no unit counts bytes.
    absl::StrAppend(&line, s.unit() == "tokens" ? TokenCounts(s, running) : ByteCounts(s, running));
  }
  if (running && s.has_eta_seconds()) {
    absl::StrAppend(&line, "  ETA ", job::FormatDuration(s.eta_seconds()));
  }
  if (s.state() == v1::StageProgress::SUCCEEDED) {
    absl::StrAppend(&line, "  done");
    if (IsSet(s.start_time()) && IsSet(s.end_time())) {
      absl::StrAppend(&line, " in ",
                      job::FormatDuration(Seconds(s.end_time()) - Seconds(s.start_time())));
    }
  } else if (s.state() == v1::StageProgress::FAILED) {
    absl::StrAppend(&line, "  failed");
  }
  return line;
}

std::vector<std::string> JobLines(const v1::Job& job) {
  std::vector<std::string> lines = {FormatJobHeader(job)};
  for (const v1::StageProgress& s : job.stages()) lines.push_back(FormatStageLine(s));
  if (!job.last_error().empty()) lines.push_back(absl::StrCat("last error: ", job.last_error()));
  return lines;
}

ProgressView::ProgressView(std::ostream* out, bool tty, size_t width)
    : out_(out), tty_(tty), width_(width) {}

void ProgressView::Show(const v1::Job& job) {
  if (tty_) {
    Redraw(job);
  } else {
    PrintChanges(job);
  }
  out_->flush();
}

void ProgressView::Redraw(const v1::Job& job) {
  // Back to the first line of the previous drawing, and clear from there to the end of screen.
  if (lines_drawn_ > 0) *out_ << "\x1b[" << lines_drawn_ << "A";
  *out_ << "\r\x1b[J";
  const std::vector<std::string> lines = JobLines(job);
  for (const std::string& line : lines) {
    *out_ << (width_ > 1 && line.size() >= width_ ? line.substr(0, width_ - 1) : line) << "\n";
  }
  lines_drawn_ = lines.size();
}

void ProgressView::PrintChanges(const v1::Job& job) {
  // A job that stopped (finished, failed, paused) says so after its last stage lines.
  const bool stopped = job.state() == v1::SUCCEEDED || job.state() == v1::FAILED ||
                       job.state() == v1::CANCELLED || job.state() == v1::PAUSED;
  const std::string header = FormatJobHeader(job);
  const bool header_changed = last_["job"] != header;
  last_["job"] = header;
  if (header_changed && !stopped) *out_ << header << "\n";
  for (const v1::StageProgress& s : job.stages()) {
    // A line is reprinted when its state or task count moved and its text differs: a stage
    // that starts without progress yet (PENDING -> RUNNING, 0/4) would repeat the same line.
    const std::string key = StageChangeKey(s);
    auto it = last_key_.find(s.kind());
    if (it != last_key_.end() && it->second == key) continue;
    last_key_[s.kind()] = key;
    const std::string line = FormatStageLine(s);
    if (last_[s.kind()] == line) continue;
    *out_ << line << "\n";
    last_[s.kind()] = line;
  }
  if (!job.last_error().empty() && last_["error"] != job.last_error()) {
    *out_ << "last error: " << job.last_error() << "\n";
    last_["error"] = job.last_error();
  }
  if (header_changed && stopped) *out_ << header << "\n";
}

}  // namespace quantd::client
