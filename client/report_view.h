// The `quantctl report` text: a summary line, the worst tensors, the input amax of each decoder
// layer, who ran the tasks (with remote workers) and the export-rule checks.
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
//
// When another job calibrated the same source on the same data in the other numerics mode
// (report.numerics_peer_job), after the calibration section:
//
//   numerics: input amax against job 4 (math), same source and calibration data
//     max |a_official - a_math| / a_math 2.31 % at layers.1.ffn.experts.5.w2 over 120 modules
//   LAYER  MODULES  MAX REL DIFF  AT
//   0           60        1.20 %  ffn.experts.3.w1
//   1           60        2.31 %  ffn.experts.5.w2
//
// When the evaluate stage finished (report.evaluation set), after the calibration section:
//
//   evaluation: 32 held-out samples, 16384 tokens, 16352 positions compared (official numerics)
//     KL(source || quantized)  mean 0.0123  p99 0.0871  max 0.312 nats
//     top-1 agreement          97.85 %
//     perplexity               5.214 → 5.301  (ratio 1.0167)
//     gate                     PASSED
//     stage time               41.2 s, 2.6× calibration
//
//   hidden-state SQNR per layer, quantized against source
//   LAYER  FREE-RUNNING dB  TEACHER-FORCED dB
//   0                41.20              43.10
//   1                  inf                inf
//   teacher-forced  ▁█            (terminal only: ▁ lowest finite .. █ highest, inf █)
//   layers that lose the most: 0 (43.10 dB)
//
// When a remote worker ran at least one of the job's tasks (report.tasks), before the rule checks:
//
//   tasks: who ran them (local: this quantd)
//   STAGE     TASK                              ATTEMPT  RESULT  RAN BY
//   inspect   inspect                                 1  done    local
//   quantize  model-00001-of-00002.safetensors        2  done    gpu-node-3
#ifndef QUANTD_CLIENT_REPORT_VIEW_H_
#define QUANTD_CLIENT_REPORT_VIEW_H_

#include <string>

#include "quantd/v1/quantd.pb.h"

namespace quantd::client {

// `terminal`: stdout is a terminal, which also gets the sparkline of the evaluation section.
std::string FormatReport(const v1::JobReport& report, bool terminal);

}  // namespace quantd::client

#endif  // QUANTD_CLIENT_REPORT_VIEW_H_
