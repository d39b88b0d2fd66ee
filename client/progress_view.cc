#include "client/progress_view.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "server/job/progress.h"

namespace quantd::client {
namespace {

// What a plain (non-TTY) stage line is reprinted for.
std::string StageChangeKey(const v1::StageProgress& s) {
  return absl::StrCat(s.state(), " ", s.tasks_done(), "/", s.tasks_total());
}

std::string StageLine(const v1::StageProgress& s) {
  return job::FormatStageLine(s, job::StageLineStyle::kBar);
}

}  // namespace

std::string FormatJobHeader(const v1::Job& job) {
  std::string line = absl::StrCat("job ", job.id(), " ", v1::JobState_Name(job.state()));
  if (!job.reason().empty()) absl::StrAppend(&line, " (", job.reason(), ")");
  if (job.task_retries() > 0) absl::StrAppend(&line, "  retries ", job.task_retries());
  return line;
}

std::string FormatStageWorkers(const v1::StageProgress& stage) {
  std::vector<std::string> runners;
  for (const v1::StageWorker& w : stage.workers()) {
    runners.push_back(
        absl::StrCat(w.worker().empty() ? "local" : w.worker(), " (", w.tasks(), ")"));
  }
  return absl::StrCat("           workers: ", absl::StrJoin(runners, ", "));
}

std::vector<std::string> JobLines(const v1::Job& job) {
  std::vector<std::string> lines = {FormatJobHeader(job)};
  for (const v1::StageProgress& s : job.stages()) {
    lines.push_back(StageLine(s));
    if (s.workers_size() > 0) lines.push_back(FormatStageWorkers(s));
  }
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
    const std::string line = StageLine(s);
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
