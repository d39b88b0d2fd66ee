// An amax table as the job store keeps it (store::AmaxRow, kind "input"; TaskRecord::PutTaskAmax
// per calibrate task, JobStore::ListAmax merged by max and summed token counts): one row per module
// under its official name ("layers.3.ffn.experts.5.w1") with the token count in `samples`, and for
// a routed w2 the weighted amax under the module's name and the unweighted one under
// "<module>.unweighted". `quantctl report` reads exactly these rows.
#ifndef QUANTD_SERVER_CALIBRATION_AMAX_ROWS_H_
#define QUANTD_SERVER_CALIBRATION_AMAX_ROWS_H_

#include <vector>

#include "server/calibration/amax_table.h"
#include "server/store/job_store.h"

namespace quantd::calibration {

inline constexpr char kUnweightedSuffix[] = ".unweighted";

std::vector<store::AmaxRow> ToAmaxRows(const AmaxTable& table);
// The table of `rows` (kind "input"; other kinds are passed over). It names no slice.
AmaxTable FromAmaxRows(const std::vector<store::AmaxRow>& rows);

}  // namespace quantd::calibration

#endif  // QUANTD_SERVER_CALIBRATION_AMAX_ROWS_H_
