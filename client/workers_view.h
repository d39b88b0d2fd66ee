// `quantctl workers`: the remote workers as a table (name, address, devices with memory, the
// tasks they run now, tasks leased, seconds since their last call).
#ifndef QUANTD_CLIENT_WORKERS_VIEW_H_
#define QUANTD_CLIENT_WORKERS_VIEW_H_

#include <string>

#include "absl/time/time.h"
#include "quantd/v1/quantd.pb.h"

namespace quantd::client {

// One row per worker under the heading NAME ADDRESS DEVICES TASK LEASED LAST SEEN; `now` dates
// the last-seen ages. "no remote workers\n" when there is none.
std::string FormatWorkers(const v1::ListWorkersResponse& workers, absl::Time now);

}  // namespace quantd::client

#endif  // QUANTD_CLIENT_WORKERS_VIEW_H_
