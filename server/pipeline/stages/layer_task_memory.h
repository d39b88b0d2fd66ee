// The memory a calibrate or evaluate task holds while it runs, stated in its plan
// (compute::DeviceRequirement::memory_bytes) so that the scheduler starts no more layer tasks on a
// device than fit and fails a job whose task fits on none of its devices, naming the figure. It
// is the layer model of model/v4_memory.h (dense weights decoded, one routed expert at a time)
// plus the activations the task keeps: its input and output streams and one batch's working
// memory (calibration::EstimateBatchBytes).
#ifndef QUANTD_SERVER_PIPELINE_STAGES_LAYER_TASK_MEMORY_H_
#define QUANTD_SERVER_PIPELINE_STAGES_LAYER_TASK_MEMORY_H_

#include <stdint.h>

#include "server/checkpoint/tensor_inventory.h"
#include "server/model/v4_config.h"

namespace quantd::pipeline {

// Bytes of `tokens` token rows of activations between layers (hc_mult streams of hidden_size
// float32 values and the token id).
int64_t StreamBytes(const model::V4Config& config, int64_t tokens);

// The working memory of the largest batch `samples` samples of at most `seq_len` tokens can form
// (calibration::PlanBatches): a sequence over the batch budget gets a batch of its own, and no
// batch holds more than every sample. Sizes a task before its tokens exist.
int64_t LargestBatchBytes(const model::V4Config& config, int64_t samples, int64_t seq_len);

// A calibrate task of `layer` over a slice of `slice_tokens` tokens whose largest batch needs
// `batch_bytes` of working memory: the source layer, the batch, the slice's input and output.
int64_t CalibrateLayerTaskBytes(const model::V4Config& config,
                                const checkpoint::TensorInventory& source, int64_t layer,
                                int64_t slice_tokens, int64_t batch_bytes);

// An evaluate task of `layer` over `tokens` held-out tokens: the source layer as stored, the
// quantized layer (not written at planning: every linear counted as float32, what NVFP4 decodes
// to), one batch, and four sets of streams (source and quantized inputs and outputs).
int64_t EvaluateLayerTaskBytes(const model::V4Config& config,
                               const checkpoint::TensorInventory& source, int64_t layer,
                               int64_t tokens, int64_t batch_bytes);

// The evaluate head task: both models' head weights decoded (counted as float32), the float32
// logits of one sequence of `seq_len` tokens for each, and the last layer's streams of both
// models for `tokens` tokens.
int64_t EvaluateHeadTaskBytes(const model::V4Config& config, int64_t tokens, int64_t seq_len);

}  // namespace quantd::pipeline

#endif  // QUANTD_SERVER_PIPELINE_STAGES_LAYER_TASK_MEMORY_H_
