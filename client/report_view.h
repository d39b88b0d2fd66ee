// The `quantctl report` text: a summary line, the worst tensors, the input amax of each decoder
// layer and the export-rule checks.
//
//   job 7 SUCCEEDED  48 tensors  min SQNR 18.52 dB  mean SQNR 19.87 dB
//
//   TENSOR                             REL RMSE  SQNR dB  MAX ABS ERR
//   layers.1.ffn.experts.3.w2.weight     0.1187    18.52      0.04211
//
//   calibration: input amax per decoder layer (routed experts: min / median / max)
//   LAYER  TOKENS  UNCALIBRATED  PROJECTION                 MIN  MEDIAN   MAX
//   0        4096  1 of 8        attn.wq_a                                3.25
//                                ffn.experts.w1             0.5    1.75   2.5
//                                ffn.experts.w2             0.25    0.5  0.75
//                                ffn.experts.w2.unweighted    4       5     6
//
// (TOKENS is "-" when the amax came from calibration.amax_file, which counts no tokens;
// UNCALIBRATED, the routed experts whose amax the export fills in, "-" for a layer without any.)
//
//   rule checks: 1 of 2 passed
//     PASS  verify model-00001-of-00002.safetensors
//     FAIL  verify model-00002-of-00002.safetensors
//           <each line of the check's message>
#ifndef QUANTD_CLIENT_REPORT_VIEW_H_
#define QUANTD_CLIENT_REPORT_VIEW_H_

#include <string>

#include "quantd/v1/quantd.pb.h"

namespace quantd::client {

std::string FormatReport(const v1::JobReport& report);

}  // namespace quantd::client

#endif  // QUANTD_CLIENT_REPORT_VIEW_H_
