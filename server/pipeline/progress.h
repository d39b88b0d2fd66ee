// Progress of a running job for the person watching `quantd run`.
//
// On a terminal one live line is redrawn in place (at most every kRedrawMs):
//   quantize  12/64 tasks  140.2/805.3 GB  2.31 GB/s  ETA 4m48s
// Elsewhere (a log file, a pipe) the same line is printed once per finished task, followed by the
// task's name. Bytes are source bytes: finished tasks count their planned bytes_total, running
// tasks what they reported through StageContext::add_progress so far.
#ifndef QUANTD_SERVER_PIPELINE_PROGRESS_H_
#define QUANTD_SERVER_PIPELINE_PROGRESS_H_

#include <stdint.h>

#include <atomic>
#include <chrono>
#include <optional>
#include <ostream>
#include <string>

namespace quantd::pipeline {

// What one progress line shows.
struct ProgressSnapshot {
  std::string stage;
  int64_t tasks_done = 0;
  int64_t tasks_total = 0;
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;                // 0: the stage has no byte count (inspect, export)
  std::optional<double> bytes_per_second;  // unset until this process has processed a byte
};

// "quantize  12/64 tasks  140.2/805.3 GB  2.31 GB/s  ETA 4m48s". Sizes in GB (1e9) when the
// stage's total reaches 1 GB, else in MB (1e6); the rate uses the same unit.
std::string FormatProgressLine(const ProgressSnapshot& s);
// "45s", "4m48s", "2h05m".
std::string FormatDuration(double seconds);

class ProgressPrinter {
 public:
  static constexpr int64_t kRedrawMs = 250;

  // `out` == nullptr prints nothing (the counters still work). `tty`: redraw one line in place.
  ProgressPrinter(std::ostream* out, bool tty);
  ~ProgressPrinter();
  ProgressPrinter(const ProgressPrinter&) = delete;
  ProgressPrinter& operator=(const ProgressPrinter&) = delete;

  // A stage starts (or resumes): its totals and what earlier runs already finished.
  void BeginStage(const std::string& kind, int64_t tasks_total, int64_t tasks_done,
                  uint64_t bytes_total, uint64_t bytes_done);
  // Thread-safe: a running task processed `n` more source bytes.
  void AddBytes(uint64_t n) { running_bytes_.fetch_add(n, std::memory_order_relaxed); }
  // A task finished: its planned bytes replace the `reported` bytes it added while running.
  void TaskDone(const std::string& name, uint64_t bytes_total, uint64_t reported);
  // A task stopped without finishing: the bytes it reported no longer count.
  void TaskAbandoned(uint64_t reported);
  // Redraws the terminal line when kRedrawMs have passed since the last draw.
  void Tick();
  // A log line of its own (the terminal line is cleared first and redrawn by the next Tick).
  void Message(const std::string& line);
  // Ends the current stage's line (terminal: final redraw and newline).
  void EndStage();

  ProgressSnapshot Snapshot() const;

 private:
  using Clock = std::chrono::steady_clock;
  void Draw();
  void ClearLine();

  std::ostream* out_;                       // where lines go; nullptr = nowhere
  bool tty_;                                // redraw in place instead of log lines
  bool stage_open_ = false;                 // a stage began and has not ended
  bool line_drawn_ = false;                 // the terminal shows a partial line
  std::string stage_;                       // kind of the current stage
  int64_t tasks_total_ = 0;                 // of the current stage
  int64_t tasks_done_ = 0;                  // of the current stage, earlier runs included
  uint64_t bytes_total_ = 0;                // of the current stage
  uint64_t bytes_done_ = 0;                 // planned bytes of its finished tasks
  uint64_t bytes_done_at_begin_ = 0;        // bytes_done_ when this process began the stage
  std::atomic<uint64_t> running_bytes_{0};  // reported by tasks still running (AddBytes)
  Clock::time_point begin_;                 // when this process began the stage
  Clock::time_point last_draw_;             // last terminal redraw
};

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_PROGRESS_H_
