// The official-vs-math comparison of a job's calibration (issue 12 item 4): when the store holds
// another job that calibrated the same source on the same data with the other
// calibration.numerics, the report shows how far the two modes' input amax lie apart, per decoder
// layer and over the job (quantd.proto JobReport fields 10-14, LayerReport fields 15-18).
//
// The two modes differ only in the forward's roundings (official: the BF16 / FP8 activation
// simulation of the reference code; math: FP32 throughout), so the same token ids give amax a few
// percent apart; a larger difference points at the forward, not at the data.
#ifndef QUANTD_SERVER_SCHEDULER_NUMERICS_COMPARISON_H_
#define QUANTD_SERVER_SCHEDULER_NUMERICS_COMPARISON_H_

#include <stdint.h>

#include <vector>

#include "absl/status/status.h"
#include "quantd/v1/quantd.pb.h"
#include "server/job/job_spec.h"
#include "server/store/job_store.h"

namespace quantd::scheduler {

// Whether `a` and `b` calibrate on data from the same source path with the same calibration data
// (dataset or datasets with their sample counts, num_samples, seq_len, min_seq_len, seed, add_bos,
// calibrate_all_experts) and different numerics: the token ids and the experts they reach are
// then the same, and only the forward's roundings differ. The export choices (w2_input,
// expert_amax, uncalibrated, amax_out) do not change the recorded rows and are not compared.
bool SameCalibrationOtherNumerics(const job::JobSpec& a, const job::JobSpec& b);

// Compares the input amax rows (store::JobStore::ListAmax) of the report's job, calibrated with
// `numerics`, against those of `peer_job`, calibrated with the other mode: for every module with
// an "input" row in both, |a_official - a_math| / a_math (0 when both are 0, +inf when only
// a_math is). Sets the report's numerics_* fields, and those of each of its LayerReports
// (report->layers, from AddLayerCalibration) whose layer has a module in both.
void AddNumericsComparison(const std::vector<store::AmaxRow>& amax,
                           job::CalibrationNumerics numerics, int64_t peer_job,
                           const std::vector<store::AmaxRow>& peer_amax, v1::JobReport* report);

// Finds the peer of job `job_id` (spec `spec`, its calibrate tasks in `tasks`) in `store`: the
// latest other job for which SameCalibrationOtherNumerics holds, whose calibrate stage SUCCEEDED
// and whose calibrate plan covers the same number of decoder layers (the store keeps no digest of
// the source's files, so a source rewritten in place between the two jobs goes unnoticed). With
// one, AddNumericsComparison; without one, nothing. Reads only.
absl::Status AddNumericsComparisonFromStore(store::JobStore& store, int64_t job_id,
                                            const job::JobSpec& spec,
                                            const std::vector<store::AmaxRow>& amax,
                                            const std::vector<store::TaskRow>& tasks,
                                            v1::JobReport* report);

}  // namespace quantd::scheduler

#endif  // QUANTD_SERVER_SCHEDULER_NUMERICS_COMPARISON_H_
