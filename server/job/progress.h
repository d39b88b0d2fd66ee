// Progress of a job for the person watching it, one formatter for `quantctl watch` and
// `quantd run` (both read the scheduler's v1::StageProgress snapshots):
//
//   quantctl:   quantize   [#####...............]  12/48 tasks  140.2/805.3 GB  2.31 GB/s  ETA 4m48s
//   quantd run: quantize  12/48 tasks  140.2/805.3 GB  2.31 GB/s  ETA 4m48s
//
// Bytes are source bytes: finished tasks count their planned bytes_total, running tasks what
// they reported through StageContext::add_progress so far. A stage whose unit is "tokens" (the
// calibrate and evaluate stages) counts tokens: "calibrate  3/8 tasks  layer 2 of 3
// 1.2k/3.0k tokens  4.1k tokens/s  ETA 3s".
//
// `quantd run` shows one live line (ProgressPrinter): on a terminal it is redrawn in place (at
// most every kRedrawMs); elsewhere (a log file, a pipe) it is printed once per finished task.
#ifndef QUANTD_SERVER_JOB_PROGRESS_H_
#define QUANTD_SERVER_JOB_PROGRESS_H_

#include <stdint.h>

#include <chrono>
#include <ostream>
#include <string>

#include "quantd/v1/quantd.pb.h"

namespace quantd::job {

// "45s", "4m48s", "2h05m".
std::string FormatDuration(double seconds);

enum class StageLineStyle {
  kBar,    // quantctl: the kind padded to 9 columns, then a 20-column bar
  kPlain,  // quantd run: the kind, then the counts
};

// One stage: kind, (bar: bytes done when the stage counts bytes, else tasks done), tasks, while
// running its step ("layer 2 of 3"), the counts in the stage's unit (bytes: GB from 1 GB of stage
// total, else MB; tokens: "1.2k/3.0k tokens"), and while running the rate and the ETA; "done in
// 4m48s" / "failed" at the end. A stage without a unit counts bytes.
std::string FormatStageLine(const v1::StageProgress& stage, StageLineStyle style);

class ProgressPrinter {
 public:
  static constexpr int64_t kRedrawMs = 250;

  // `out` == nullptr prints nothing. `tty`: redraw one line in place.
  ProgressPrinter(std::ostream* out, bool tty);
  ~ProgressPrinter();
  ProgressPrinter(const ProgressPrinter&) = delete;
  ProgressPrinter& operator=(const ProgressPrinter&) = delete;

  // The latest progress of the stage being watched. On a terminal the line is redrawn, at once
  // when the stage or its task count changed and otherwise at most every kRedrawMs; elsewhere a
  // line is printed each time the task count grows.
  void Show(const v1::StageProgress& s);
  // A log line of its own (the terminal line is cleared first and redrawn by the next Show).
  void Message(const std::string& line);
  // Ends the live line (terminal: final redraw and newline).
  void Finish();

 private:
  using Clock = std::chrono::steady_clock;
  void Draw();
  void ClearLine();

  std::ostream* out_;            // where lines go; nullptr = nowhere
  bool tty_;                     // redraw in place instead of log lines
  bool shown_ = false;           // `last_` holds a snapshot that Finish has not ended
  bool line_drawn_ = false;      // the terminal shows a partial line
  v1::StageProgress last_;       // the latest snapshot
  Clock::time_point last_draw_;  // last terminal redraw
};

}  // namespace quantd::job

#endif  // QUANTD_SERVER_JOB_PROGRESS_H_
