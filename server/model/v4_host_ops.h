// The forward's operations on the host (v4_forward_ops.h): host memory, loops split over the
// context's host threads, products through its Gemm. The block functions of v4_linear.h,
// v4_mhc.h, v4_attention.h, v4_rope.h, v4_attention_sparse.h, v4_compressor.h, v4_indexer.h and
// v4_moe.h are their bodies, and the oracle the CUDA ops are tested against.
#ifndef QUANTD_SERVER_MODEL_V4_HOST_OPS_H_
#define QUANTD_SERVER_MODEL_V4_HOST_OPS_H_

#include <memory>

#include "server/model/v4_forward_ops.h"

namespace quantd::model {

// The host ops; stateless (everything comes from the ForwardContext).
const ForwardOps& HostOps();
std::shared_ptr<ForwardOps> MakeHostOps();

}  // namespace quantd::model

#endif  // QUANTD_SERVER_MODEL_V4_HOST_OPS_H_
