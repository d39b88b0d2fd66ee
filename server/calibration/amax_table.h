// The calibration's record: per module (official name, one row per routed expert and projection)
// the largest |x| of the BF16 input the forward gave it, before the FP8 activation simulation, and
// how many token rows reached it. Slices of the samples are recorded separately and merged by
// max (amax) and sum (tokens); every table names the slices it holds ("layer 3 slice 1 of 2"), so
// merging a slice twice changes nothing and the merged table, like its serialization, does not
// depend on the order the slices arrive in.
#ifndef QUANTD_SERVER_CALIBRATION_AMAX_TABLE_H_
#define QUANTD_SERVER_CALIBRATION_AMAX_TABLE_H_

#include <stdint.h>

#include <map>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace quantd::calibration {

struct AmaxEntry {
  // max |x| of the input as the forward gives it. For a routed expert's w2 that is the input
  // with the routing weight applied (the official code and NVIDIA's recipe).
  float amax = 0.0f;
  // Routed experts' w2 only: max |x| of the input without the routing weight (what vLLM, SGLang
  // and TensorRT-LLM quantize); 0 for every other module.
  float unweighted_amax = 0.0f;
  int64_t tokens = 0;  // input rows (tokens) that reached the module
  bool has_unweighted = false;  // true for routed experts' w2
};

class AmaxTable {
 public:
  // Records `rows` input rows of `module` with largest |x| `amax` (and, for a routed w2, the
  // unweighted largest |x|). Only for the table of one slice being recorded.
  void Record(const std::string& module, float amax, int64_t rows);
  void RecordW2(const std::string& module, float weighted_amax, float unweighted_amax,
                int64_t rows);

  // Sets `module`'s record (a table rebuilt from stored rows, calibration/amax_rows.h).
  void Put(const std::string& module, const AmaxEntry& entry) { entries_[module] = entry; }

  // Names the slice this table holds; a table being recorded holds exactly one.
  void AddSlice(const std::string& slice) { slices_.insert(slice); }

  // Max-reduces `other` into this table. A no-op when every slice of `other` is already here
  // (a rerun); FailedPrecondition when only some are (the two tables overlap, and the token
  // counts would be counted twice); InvalidArgument when `other` names no slice.
  absl::Status Merge(const AmaxTable& other);

  const std::map<std::string, AmaxEntry>& entries() const { return entries_; }
  const std::set<std::string>& slices() const { return slices_; }

  // Canonical JSON: {"format": "quantd-amax-table/1", "slices": [...sorted],
  // "modules": {module: {"amax": F, "tokens": N[, "unweighted_amax": F]}}} with modules sorted and
  // floats printed to round-trip exactly. Equal tables give equal bytes.
  std::string Serialize() const;
  // Parses Serialize()'s output; `origin` names the source in errors.
  static absl::StatusOr<AmaxTable> Parse(const std::string& text, const std::string& origin);

  bool operator==(const AmaxTable& other) const;

 private:
  std::map<std::string, AmaxEntry> entries_;  // module -> its record
  std::set<std::string> slices_;              // the slices merged into this table
};

}  // namespace quantd::calibration

#endif  // QUANTD_SERVER_CALIBRATION_AMAX_TABLE_H_
