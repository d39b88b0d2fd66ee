#include "client/workers_view.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/table.h"

namespace quantd::client {
namespace {

std::string Gib(int64_t bytes) {
  return absl::StrCat(absl::SixDigits(static_cast<double>(bytes) / (int64_t{1} << 30)), " GiB");
}

}  // namespace

std::string FormatWorkers(const v1::ListWorkersResponse& workers, absl::Time now) {
  if (workers.workers().empty()) return "no remote workers\n";
  std::vector<std::vector<std::string>> rows = {
      {"NAME", "ADDRESS", "DEVICES", "TASK", "LEASED", "LAST SEEN"}};
  for (const v1::WorkerInfo& w : workers.workers()) {
    std::vector<std::string> devices;
    for (const v1::WorkerDevice& d : w.devices()) {
      devices.push_back(absl::StrCat(d.name(), " (", Gib(d.memory_bytes()), ")"));
    }
    const absl::Time seen = absl::FromUnixSeconds(w.last_seen_time().seconds()) +
                            absl::Nanoseconds(w.last_seen_time().nanos());
    const int64_t ago = absl::ToInt64Seconds(now - seen);
    rows.push_back({w.name(), w.peer(), absl::StrJoin(devices, ", "),
                    w.tasks().empty() ? "-" : absl::StrJoin(w.tasks(), "; "),
                    absl::StrCat(w.tasks_leased()), absl::StrCat(ago < 0 ? 0 : ago, " s ago")});
  }
  return FormatTable(rows, "lllllr");
}

}  // namespace quantd::client
