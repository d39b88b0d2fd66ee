// What the observer is shown for the input of one linear call, built once for both op sets
// (ApplyLinear on the host, v4_cuda_ops.cc's Linear on a CUDA device).
#ifndef QUANTD_SERVER_MODEL_V4_LINEAR_INPUT_H_
#define QUANTD_SERVER_MODEL_V4_LINEAR_INPUT_H_

#include <stdint.h>

#include "server/model/v4_linear.h"
#include "server/model/v4_observer.h"

namespace quantd::model {

// The observer's view of `rows` rows of `x` entering `w`, with the facts of the call.
LinearInput LinearInputOf(const LinearWeight& w, const float* x, int64_t rows,
                          const LinearRows& facts);

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_LINEAR_INPUT_H_
