// The `quantctl report` text: a summary line, the worst tensors and the export-rule checks.
//
//   job 7 SUCCEEDED  48 tensors  min SQNR 18.52 dB  mean SQNR 19.87 dB
//
//   TENSOR                             REL RMSE  SQNR dB  MAX ABS ERR
//   layers.1.ffn.experts.3.w2.weight     0.1187    18.52      0.04211
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
