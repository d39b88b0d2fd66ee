#include "server/calibration/amax_observer.h"

#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace quantd::calibration {
namespace {

// max |x| over rows x cols with row stride ld; NaN when any value is not finite.
float MaxAbs(const float* x, int64_t rows, int64_t cols, int64_t ld) {
  float m = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * ld;
    for (int64_t c = 0; c < cols; ++c) {
      const float a = std::fabs(row[c]);
      if (!std::isfinite(a)) return NAN;
      m = a > m ? a : m;
    }
  }
  return m;
}

}  // namespace

float UnweightedW2Bound(float swiglu_limit) {
  if (swiglu_limit <= 0.0f) return 0.0f;
  const double l = swiglu_limit;
  return static_cast<float>(l * l / (1.0 + std::exp(-l)) * (1.0 + 1.0 / 256));
}

AmaxObserver::AmaxObserver(AmaxTable* table, int64_t layer, float swiglu_limit)
    : table_(table), layer_(layer), w2_bound_(UnweightedW2Bound(swiglu_limit)) {}

void AmaxObserver::OnLinearInput(const model::LinearInput& in) {
  const auto start = std::chrono::steady_clock::now();
  const std::string& module = *in.module;
  const float amax = MaxAbs(in.x, in.rows, in.cols, in.ld);
  float unweighted = 0.0f;
  if (in.unweighted_x != nullptr) unweighted = MaxAbs(in.unweighted_x, in.rows, in.cols, in.ld);
  if (status_.ok()) {
    if (std::isnan(amax) || std::isnan(unweighted)) {
      status_ = absl::DataLossError(absl::StrCat("layer ", layer_, ": the input of ", module,
                                                 " has a value that is not finite"));
    } else if (in.unweighted_x != nullptr && w2_bound_ > 0.0f && unweighted > w2_bound_) {
      status_ = absl::InternalError(absl::StrCat(
          "layer ", layer_, " expert ", in.expert, ": unweighted w2 input amax ", unweighted,
          " of ", module, " exceeds the clamped SwiGLU bound ", w2_bound_));
    }
  }
  if (in.unweighted_x != nullptr) {
    // Rows without a routing weight (calibrate_all_experts) have no weighted input.
    table_->RecordW2(module, in.routing_weights != nullptr ? amax : 0.0f, unweighted, in.rows);
  } else {
    table_->Record(module, amax, in.rows);
  }
  record_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace quantd::calibration
