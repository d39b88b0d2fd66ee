// How quantctl shows a job: a header line, one line per stage and the last error.
//
//   job 7 RUNNING
//   inspect    [####################]  1/1 tasks  done in 0s
//   quantize   [#####...............]  12/48 tasks  140.2/805.3 GB  2.31 GB/s  ETA 4m48s
//   export     [....................]  0/4 tasks
//
// (the stage lines: job::FormatStageLine, server/job/progress.h, shared with `quantd run`). A
// stage some of whose done tasks a remote worker ran is followed by who ran them, "local" being
// the daemon itself:
//
//   quantize   [####################]  5/5 tasks  805.3/805.3 GB  done in 4m48s
//              workers: gpu-a (3), gpu-b (2)
//
// ProgressView follows a job through WatchJob messages: on a terminal it redraws all lines in
// place (ANSI cursor-up); elsewhere it prints a line only when it changed (for a stage: its
// state or its task count, not every byte), so logs stay short.
#ifndef QUANTD_CLIENT_PROGRESS_VIEW_H_
#define QUANTD_CLIENT_PROGRESS_VIEW_H_

#include <stddef.h>

#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "quantd/v1/quantd.pb.h"

namespace quantd::client {

// "job 7 RUNNING (cancelling)  retries 2": id, state, reason when set, retries when any.
std::string FormatJobHeader(const v1::Job& job);
// "           workers: a (3), local (1)": who ran the stage's done tasks (stage.workers).
std::string FormatStageWorkers(const v1::StageProgress& stage);
// The header, one line per stage (and its workers line when it has workers), and
// "last error: ..." when the job has one.
std::vector<std::string> JobLines(const v1::Job& job);

class ProgressView {
 public:
  // `tty`: redraw in place, each line cut to `width` - 1 columns when `width` > 0 (a wrapped
  // line would break the cursor-up count).
  ProgressView(std::ostream* out, bool tty, size_t width);

  // Shows the job's latest snapshot.
  void Show(const v1::Job& job);

 private:
  void Redraw(const v1::Job& job);
  void PrintChanges(const v1::Job& job);

  std::ostream* out_;                        // where the view is drawn
  bool tty_;                                 // redraw in place instead of printing changes
  size_t width_;                             // tty: terminal columns, 0 = unknown
  size_t lines_drawn_ = 0;                   // tty: lines of the previous drawing
  std::map<std::string, std::string> last_;  // plain: per line ("job", "error", stage kind),
                                             // what it showed when last printed
  std::map<std::string, std::string> last_key_;  // plain: per stage kind, the state and task
                                                 // counts when its line was last printed
};

}  // namespace quantd::client

#endif  // QUANTD_CLIENT_PROGRESS_VIEW_H_
