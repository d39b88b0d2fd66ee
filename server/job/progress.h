// Progress of a running job for the person watching `quantd run`.
//
// On a terminal one live line is redrawn in place (at most every kRedrawMs):
//   quantize  12/64 tasks  140.2/805.3 GB  2.31 GB/s  ETA 4m48s
// Elsewhere (a log file, a pipe) the same line is printed once per finished task. Bytes are
// source bytes: finished tasks count their planned bytes_total, running tasks what they reported
// through StageContext::add_progress so far (the scheduler's snapshots carry both). The calibrate
// and evaluate stages count tokens instead: "calibrate  3/8 tasks  1536/4096 tokens  410 tokens/s".
#ifndef QUANTD_SERVER_JOB_PROGRESS_H_
#define QUANTD_SERVER_JOB_PROGRESS_H_

#include <stdint.h>

#include <chrono>
#include <optional>
#include <ostream>
#include <string>

namespace quantd::job {

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

  // `out` == nullptr prints nothing. `tty`: redraw one line in place.
  ProgressPrinter(std::ostream* out, bool tty);
  ~ProgressPrinter();
  ProgressPrinter(const ProgressPrinter&) = delete;
  ProgressPrinter& operator=(const ProgressPrinter&) = delete;

  // The latest progress. On a terminal the line is redrawn, at once when the stage or its task
  // count changed and otherwise at most every kRedrawMs; elsewhere a line is printed each time
  // the task count grows.
  void Show(const ProgressSnapshot& s);
  // A log line of its own (the terminal line is cleared first and redrawn by the next Show).
  void Message(const std::string& line);
  // Ends the live line (terminal: final redraw and newline).
  void Finish();

 private:
  using Clock = std::chrono::steady_clock;
  void Draw();
  void ClearLine();

  std::ostream* out_;               // where lines go; nullptr = nowhere
  bool tty_;                        // redraw in place instead of log lines
  bool shown_ = false;              // `last_` holds a snapshot that Finish has not ended
  bool line_drawn_ = false;         // the terminal shows a partial line
  ProgressSnapshot last_;           // the latest snapshot
  Clock::time_point last_draw_;     // last terminal redraw
};

}  // namespace quantd::job

#endif  // QUANTD_SERVER_JOB_PROGRESS_H_
