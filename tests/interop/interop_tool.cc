// quantd_interop_tool: runs quantd's CPU kernels and safetensors reader/writer on files that the
// Python interop tests (tests/interop/*.py) produce, and writes results the peer libraries read.
//
//   nvfp4 IN OUT [--group A,B ...]   every 2-D BF16/F32 tensor NAME -> NAME.weight (U8),
//                                    NAME.weight_scale (F8_E4M3), NAME.weight_scale_2 (F32 []),
//                                    NAME.dequant (F32); a group shares one global amax
//   decode IN OUT                    FP8-block (E8M0/F32 `.scale`, F32 `weight_scale_inv`) and
//                                    MXFP4 (I8 + E8M0 `.scale`) weights -> F32, same names
//   mxfp4-to-nvfp4 IN OUT [--kmax K] MXFP4 weight <m>.weight -> <m>.weight, <m>.weight_scale,
//                                    <m>.weight_scale_2; prints the requantized block count
//   copy IN OUT                      every tensor and the metadata, read and written again
//   nvfp4-act IN OUT                 every 2-D F32 tensor NAME with an F32 [] tensor
//                                    NAME.input_scale -> NAME, NVFP4 activation fake-quantized
//                                    (kernels/nvfp4_fake_quant.h)
//   simd-levels                      the SIMD levels this CPU runs, one per line
//
// IN may be a safetensors file or (except for copy) a checkpoint directory. The global --simd
// option picks the CPU backend's level (default auto). Errors go to stderr with exit status 1.
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kernels/backend.h"
#include "kernels/backends.h"
#include "kernels/nvfp4_fake_quant.h"
#include "server/checkpoint/checkpoint_dir.h"
#include "server/checkpoint/dtype.h"
#include "server/checkpoint/safetensors_reader.h"
#include "server/checkpoint/safetensors_writer.h"

namespace quantd {
namespace {

using checkpoint::CheckpointDir;
using checkpoint::Dtype;
using checkpoint::SafetensorsFile;
using checkpoint::SafetensorsWriter;
using checkpoint::TensorSpec;
using checkpoint::TensorView;
using kernels::Backend;
using kernels::Buffer;

std::string DtypeStr(Dtype d) { return std::string(checkpoint::DtypeName(d)); }

std::string ShapeStr(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// The tensors of one safetensors file or of a whole checkpoint directory.
class Source {
 public:
  static absl::StatusOr<std::unique_ptr<Source>> Open(const std::string& path) {
    auto source = std::unique_ptr<Source>(new Source());
    if (std::filesystem::is_directory(path)) {
      auto dir = CheckpointDir::Open(path);
      if (!dir.ok()) return dir.status();
      source->dir_ = std::move(*dir);
      for (const auto& shard : source->dir_->shards()) {
        for (const TensorView& t : shard->tensors()) source->tensors_.push_back(&t);
      }
    } else {
      auto file = SafetensorsFile::Open(path);
      if (!file.ok()) return file.status();
      source->file_ = std::move(*file);
      for (const TensorView& t : source->file_->tensors()) source->tensors_.push_back(&t);
    }
    return source;
  }

  const std::vector<const TensorView*>& tensors() const { return tensors_; }
  const TensorView* Find(const std::string& name) const {
    return dir_ ? dir_->Find(name) : file_->Find(name);
  }

 private:
  Source() = default;

  std::unique_ptr<SafetensorsFile> file_;  // set when the input is one file
  std::unique_ptr<CheckpointDir> dir_;     // set when the input is a checkpoint directory
  std::vector<const TensorView*> tensors_; // every tensor, shard by shard in file order
};

// One output tensor, held in memory until the file is written (interop inputs are small).
struct OutTensor {
  TensorSpec spec;
  std::vector<uint8_t> bytes;
};

absl::Status WriteOutputs(const std::string& path, const std::vector<OutTensor>& outputs,
                          std::map<std::string, std::string> metadata = {}) {
  std::vector<TensorSpec> specs;
  for (const OutTensor& o : outputs) specs.push_back(o.spec);
  auto writer = SafetensorsWriter::Create(path, std::move(specs), std::move(metadata));
  if (!writer.ok()) return writer.status();
  for (const OutTensor& o : outputs) {
    if (auto s = (*writer)->WriteTensor(o.spec.name, o.bytes.data(), o.bytes.size()); !s.ok()) {
      return s;
    }
  }
  return (*writer)->Finish();
}

// A backend buffer of `size` bytes, filled from host memory when `host` is not null. Kernels
// always get backend memory, never pointers into the mapping (which may be unaligned).
absl::StatusOr<Buffer> Alloc(Backend& backend, size_t size, const void* host = nullptr) {
  auto buffer = backend.Allocate(size);
  if (!buffer.ok()) return buffer.status();
  if (host != nullptr) {
    if (auto s = backend.CopyToBackend(buffer->data(), host, size); !s.ok()) return s;
  }
  return buffer;
}

absl::StatusOr<std::vector<uint8_t>> Download(Backend& backend, const Buffer& buffer) {
  std::vector<uint8_t> bytes(buffer.size());
  if (auto s = backend.CopyToHost(bytes.data(), buffer.data(), bytes.size()); !s.ok()) return s;
  return bytes;
}

// Prefixes a kernel or I/O error with the tensor it concerns.
absl::Status ForTensor(const std::string& name, const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("tensor ", name, ": ", s.message()));
}

std::vector<uint8_t> FloatBytes(float f) {
  std::vector<uint8_t> bytes(sizeof(f));
  memcpy(bytes.data(), &f, sizeof(f));
  return bytes;
}

// ---- nvfp4 ------------------------------------------------------------------------------------

bool IsDense2d(const TensorView& t) {
  return (t.dtype == Dtype::kBF16 || t.dtype == Dtype::kF32) && t.shape.size() == 2;
}

// A dense input tensor copied into backend memory.
struct DenseInput {
  Buffer buffer;
  kernels::DenseTensor view;
};

absl::StatusOr<DenseInput> UploadDense(Backend& backend, const TensorView& t) {
  auto buffer = Alloc(backend, t.size, t.data);
  if (!buffer.ok()) return buffer.status();
  DenseInput in;
  in.view.data = buffer->data();
  in.view.type = t.dtype == Dtype::kF32 ? kernels::FloatType::kF32 : kernels::FloatType::kBF16;
  in.view.rows = t.shape[0];
  in.view.cols = t.shape[1];
  in.buffer = std::move(*buffer);
  return in;
}

// NVFP4 data, scales and scale_2 (plus the F32 dequantization) as output tensors.
absl::Status AppendNvfp4(Backend& backend, const std::string& prefix, const std::string& weight,
                         int64_t rows, int64_t cols, Buffer& data, Buffer& scales, float scale_2,
                         bool with_dequant, std::vector<OutTensor>* outputs) {
  auto data_bytes = Download(backend, data);
  if (!data_bytes.ok()) return data_bytes.status();
  auto scale_bytes = Download(backend, scales);
  if (!scale_bytes.ok()) return scale_bytes.status();
  if (with_dequant) {
    auto deq = Alloc(backend, static_cast<size_t>(rows * cols) * sizeof(float));
    if (!deq.ok()) return deq.status();
    kernels::Nvfp4Tensor src{data.as<uint8_t>(), scales.as<uint8_t>(), scale_2, rows, cols};
    if (auto s = backend.Nvfp4Dequant(src, {deq->data(), kernels::FloatType::kF32}); !s.ok()) {
      return s;
    }
    auto deq_bytes = Download(backend, *deq);
    if (!deq_bytes.ok()) return deq_bytes.status();
    outputs->push_back({{prefix + ".dequant", Dtype::kF32, {rows, cols}}, std::move(*deq_bytes)});
  }
  outputs->push_back({{weight, Dtype::kU8, {rows, cols / 2}}, std::move(*data_bytes)});
  outputs->push_back(
      {{prefix + ".weight_scale", Dtype::kF8E4M3, {rows, cols / 16}}, std::move(*scale_bytes)});
  outputs->push_back({{prefix + ".weight_scale_2", Dtype::kF32, {}}, FloatBytes(scale_2)});
  return absl::OkStatus();
}

absl::Status QuantizeOne(Backend& backend, const TensorView& t, kernels::GlobalAmax global_amax,
                         std::vector<OutTensor>* outputs) {
  const int64_t rows = t.shape[0];
  const int64_t cols = t.shape[1];
  if (cols % kernels::kNvfp4BlockSize != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape ", ShapeStr(t.shape), ": columns are not a multiple of 16"));
  }
  auto in = UploadDense(backend, t);
  if (!in.ok()) return in.status();
  auto data = Alloc(backend, static_cast<size_t>(rows * cols / 2));
  if (!data.ok()) return data.status();
  auto scales = Alloc(backend, static_cast<size_t>(rows * cols / 16));
  if (!scales.ok()) return scales.status();
  float scale_2 = 0.0f;
  kernels::Nvfp4Out out{data->as<uint8_t>(), scales->as<uint8_t>(), &scale_2};
  if (auto s = backend.Nvfp4Quantize(in->view, global_amax, out); !s.ok()) return s;
  return AppendNvfp4(backend, t.name, t.name + ".weight", rows, cols, *data, *scales, scale_2,
                     /*with_dequant=*/true, outputs);
}

// Parses the --group lists into tensor name -> group index, checking every name.
absl::StatusOr<std::map<std::string, int>> ParseGroups(const Source& in,
                                                       const std::vector<std::string>& groups) {
  std::map<std::string, int> group_of;
  for (int g = 0; g < static_cast<int>(groups.size()); ++g) {
    for (absl::string_view part : absl::StrSplit(groups[g], ',')) {
      const std::string name(part);
      const TensorView* t = in.Find(name);
      if (t == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("--group ", groups[g], ": no tensor ", name));
      }
      if (!IsDense2d(*t)) {
        return absl::InvalidArgumentError(absl::StrCat("--group ", groups[g], ": tensor ", name,
                                                       " is not a 2-D BF16/F32 tensor"));
      }
      if (!group_of.emplace(name, g).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("--group: tensor ", name, " is listed more than once"));
      }
    }
  }
  return group_of;
}

absl::Status RunNvfp4(Backend& backend, const std::string& in_path, const std::string& out_path,
                      const std::vector<std::string>& groups) {
  auto in = Source::Open(in_path);
  if (!in.ok()) return in.status();
  auto group_of = ParseGroups(**in, groups);
  if (!group_of.ok()) return group_of.status();

  // A group's global amax is the max of its members' amaxes.
  std::vector<float> group_amax(groups.size(), 0.0f);
  for (const auto& [name, g] : *group_of) {
    auto dense = UploadDense(backend, *(*in)->Find(name));
    if (!dense.ok()) return ForTensor(name, dense.status());
    auto amax = backend.AbsMax(dense->view);
    if (!amax.ok()) return ForTensor(name, amax.status());
    group_amax[g] = std::max(group_amax[g], *amax);
  }

  std::vector<OutTensor> outputs;
  for (const TensorView* t : (*in)->tensors()) {
    if (!IsDense2d(*t)) {
      printf("skipped %s: %s %s is not a 2-D BF16/F32 tensor\n", t->name.c_str(),
             DtypeStr(t->dtype).c_str(), ShapeStr(t->shape).c_str());
      continue;
    }
    kernels::GlobalAmax amax;
    if (auto it = group_of->find(t->name); it != group_of->end()) amax = group_amax[it->second];
    if (auto s = QuantizeOne(backend, *t, amax, &outputs); !s.ok()) return ForTensor(t->name, s);
    printf("quantized %s\n", t->name.c_str());
  }
  return WriteOutputs(out_path, outputs);
}

// ---- decode and mxfp4-to-nvfp4 ----------------------------------------------------------------

// "<m>.weight" -> "<m>"; nullopt for other names.
std::optional<std::string> ModuleOf(const std::string& weight_name) {
  const std::string suffix = ".weight";
  if (weight_name.size() <= suffix.size() ||
      weight_name.compare(weight_name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return std::nullopt;
  }
  return weight_name.substr(0, weight_name.size() - suffix.size());
}

absl::Status CheckScale(const TensorView& scale, Dtype dtype, const std::vector<int64_t>& shape) {
  if (scale.dtype != dtype || scale.shape != shape) {
    return absl::InvalidArgumentError(
        absl::StrCat("scale ", scale.name, " is ", DtypeStr(scale.dtype), " ",
                     ShapeStr(scale.shape), ", expected ", DtypeStr(dtype), " ", ShapeStr(shape)));
  }
  return absl::OkStatus();
}

// An MXFP4 weight (I8 [rows, cols/2] with an F8_E8M0 <m>.scale [rows, cols/32]) in backend memory.
struct Mxfp4Input {
  Buffer data;
  Buffer scales;
  kernels::Mxfp4Tensor view;
};

// The E8M0 `.scale` of an MXFP4 weight, or nullptr when `t` is not one.
const TensorView* Mxfp4ScaleOf(const Source& in, const TensorView& t) {
  if (t.dtype != Dtype::kI8 || t.shape.size() != 2) return nullptr;
  const std::optional<std::string> module = ModuleOf(t.name);
  if (!module) return nullptr;
  const TensorView* scale = in.Find(*module + ".scale");
  return scale != nullptr && scale->dtype == Dtype::kF8E8M0 ? scale : nullptr;
}

absl::StatusOr<Mxfp4Input> UploadMxfp4(Backend& backend, const TensorView& t,
                                       const TensorView& scale) {
  const int64_t rows = t.shape[0];
  const int64_t cols = t.shape[1] * 2;
  if (cols % kernels::kMxfp4BlockSize != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MXFP4 shape ", ShapeStr(t.shape), ": ", cols, " values per row is not a "
                     "multiple of 32"));
  }
  if (auto s = CheckScale(scale, Dtype::kF8E8M0, {rows, cols / kernels::kMxfp4BlockSize});
      !s.ok()) {
    return s;
  }
  Mxfp4Input in;
  auto data = Alloc(backend, t.size, t.data);
  if (!data.ok()) return data.status();
  auto scales = Alloc(backend, scale.size, scale.data);
  if (!scales.ok()) return scales.status();
  in.view = {data->as<uint8_t>(), scales->as<uint8_t>(), rows, cols};
  in.data = std::move(*data);
  in.scales = std::move(*scales);
  return in;
}

absl::Status DecodeFp8(Backend& backend, const Source& in, const TensorView& t,
                       std::vector<OutTensor>* outputs) {
  const int64_t rows = t.shape[0];
  const int64_t cols = t.shape[1];
  const std::vector<int64_t> scale_shape = {(rows + 127) / 128, (cols + 127) / 128};
  // V4: <m>.scale, E8M0 (or F32 in -Base checkpoints); V3: <name>_scale_inv, F32.
  const std::optional<std::string> module = ModuleOf(t.name);
  const TensorView* scale = module ? in.Find(*module + ".scale") : nullptr;
  if (scale == nullptr) scale = in.Find(t.name + "_scale_inv");
  if (scale == nullptr) {
    return absl::NotFoundError(
        "FP8 weight has neither a <module>.scale nor a <name>_scale_inv tensor");
  }
  const Dtype scale_dtype = scale->dtype == Dtype::kF8E8M0 ? Dtype::kF8E8M0 : Dtype::kF32;
  if (auto s = CheckScale(*scale, scale_dtype, scale_shape); !s.ok()) return s;
  const kernels::Fp8ScaleType scale_type = scale_dtype == Dtype::kF8E8M0
                                               ? kernels::Fp8ScaleType::kE8M0
                                               : kernels::Fp8ScaleType::kF32;
  auto data = Alloc(backend, t.size, t.data);
  if (!data.ok()) return data.status();
  auto scales = Alloc(backend, scale->size, scale->data);
  if (!scales.ok()) return scales.status();
  auto out = Alloc(backend, static_cast<size_t>(rows * cols) * sizeof(float));
  if (!out.ok()) return out.status();
  kernels::Fp8BlockTensor src{data->as<uint8_t>(), scales->data(), scale_type, rows, cols};
  if (auto s = backend.Fp8BlockDequant(src, {out->data(), kernels::FloatType::kF32}); !s.ok()) {
    return s;
  }
  auto bytes = Download(backend, *out);
  if (!bytes.ok()) return bytes.status();
  outputs->push_back({{t.name, Dtype::kF32, {rows, cols}}, std::move(*bytes)});
  return absl::OkStatus();
}

absl::Status DecodeMxfp4(Backend& backend, const TensorView& t, const TensorView& scale,
                         std::vector<OutTensor>* outputs) {
  auto in = UploadMxfp4(backend, t, scale);
  if (!in.ok()) return in.status();
  auto out = Alloc(backend, static_cast<size_t>(in->view.rows * in->view.cols) * sizeof(float));
  if (!out.ok()) return out.status();
  if (auto s = backend.Mxfp4Dequant(in->view, {out->data(), kernels::FloatType::kF32}); !s.ok()) {
    return s;
  }
  auto bytes = Download(backend, *out);
  if (!bytes.ok()) return bytes.status();
  outputs->push_back({{t.name, Dtype::kF32, {in->view.rows, in->view.cols}}, std::move(*bytes)});
  return absl::OkStatus();
}

absl::Status RunDecode(Backend& backend, const std::string& in_path, const std::string& out_path) {
  auto in = Source::Open(in_path);
  if (!in.ok()) return in.status();
  std::vector<OutTensor> outputs;
  for (const TensorView* t : (*in)->tensors()) {
    absl::Status s;
    if (t->dtype == Dtype::kF8E4M3 && t->shape.size() == 2) {
      s = DecodeFp8(backend, **in, *t, &outputs);
    } else if (const TensorView* scale = Mxfp4ScaleOf(**in, *t); scale != nullptr) {
      s = DecodeMxfp4(backend, *t, *scale, &outputs);
    } else {
      continue;
    }
    if (!s.ok()) return ForTensor(t->name, s);
    printf("decoded %s\n", t->name.c_str());
  }
  return WriteOutputs(out_path, outputs);
}

absl::Status CastOne(Backend& backend, const TensorView& t, const TensorView& scale,
                     std::optional<int> kmax_flag, std::vector<OutTensor>* outputs) {
  auto in = UploadMxfp4(backend, t, scale);
  if (!in.ok()) return in.status();
  auto own_kmax = backend.Mxfp4MaxExponent(in->view);
  if (!own_kmax.ok()) return own_kmax.status();
  const int kmax = kmax_flag.value_or(*own_kmax);
  const int64_t rows = in->view.rows;
  const int64_t cols = in->view.cols;
  auto data = Alloc(backend, static_cast<size_t>(rows * cols / 2));
  if (!data.ok()) return data.status();
  auto scales = Alloc(backend, static_cast<size_t>(rows * cols / 16));
  if (!scales.ok()) return scales.status();
  float scale_2 = 0.0f;
  kernels::Nvfp4Out out{data->as<uint8_t>(), scales->as<uint8_t>(), &scale_2};
  auto requantized = backend.Mxfp4ToNvfp4(in->view, kmax, out);
  if (!requantized.ok()) return requantized.status();
  printf("%s kmax=%d requantized_blocks=%lld\n", t.name.c_str(), kmax,
         static_cast<long long>(*requantized));
  return AppendNvfp4(backend, *ModuleOf(t.name), t.name, rows, cols, *data, *scales, scale_2,
                     /*with_dequant=*/false, outputs);
}

absl::Status RunMxfp4ToNvfp4(Backend& backend, const std::string& in_path,
                             const std::string& out_path, std::optional<int> kmax) {
  auto in = Source::Open(in_path);
  if (!in.ok()) return in.status();
  std::vector<OutTensor> outputs;
  for (const TensorView* t : (*in)->tensors()) {
    const TensorView* scale = Mxfp4ScaleOf(**in, *t);
    if (scale == nullptr) continue;
    if (auto s = CastOne(backend, *t, *scale, kmax, &outputs); !s.ok()) return ForTensor(t->name, s);
  }
  if (outputs.empty()) {
    return absl::NotFoundError(absl::StrCat(in_path, ": no MXFP4 weight (I8 <m>.weight with an "
                                            "F8_E8M0 <m>.scale)"));
  }
  return WriteOutputs(out_path, outputs);
}

// ---- copy -------------------------------------------------------------------------------------

absl::Status RunCopy(const std::string& in_path, const std::string& out_path) {
  auto in = SafetensorsFile::Open(in_path);
  if (!in.ok()) return in.status();
  std::vector<TensorSpec> specs;
  for (const TensorView& t : (*in)->tensors()) specs.push_back({t.name, t.dtype, t.shape});
  auto writer = SafetensorsWriter::Create(out_path, std::move(specs), (*in)->metadata());
  if (!writer.ok()) return writer.status();
  for (const TensorView& t : (*in)->tensors()) {
    if (auto s = (*writer)->WriteTensor(t.name, t.data, t.size); !s.ok()) return ForTensor(t.name, s);
  }
  return (*writer)->Finish();
}

absl::Status RunNvfp4Act(const std::string& in_path, const std::string& out_path) {
  auto in = Source::Open(in_path);
  if (!in.ok()) return in.status();
  std::vector<OutTensor> outputs;
  for (const TensorView* t : (*in)->tensors()) {
    const TensorView* scale = (*in)->Find(t->name + ".input_scale");
    if (t->dtype != Dtype::kF32 || t->shape.size() != 2 || scale == nullptr) continue;
    if (scale->dtype != Dtype::kF32 || scale->size != sizeof(float)) {
      return ForTensor(scale->name, absl::InvalidArgumentError("expected F32 []"));
    }
    float input_scale;
    memcpy(&input_scale, scale->data, sizeof(float));
    OutTensor out{{t->name, Dtype::kF32, t->shape}, {t->data, t->data + t->size}};
    auto* x = reinterpret_cast<float*>(out.bytes.data());
    absl::Status s = kernels::Nvfp4FakeQuantRows(x, t->shape[0], t->shape[1], t->shape[1],
                                                 input_scale);
    if (!s.ok()) return ForTensor(t->name, s);
    outputs.push_back(std::move(out));
  }
  return WriteOutputs(out_path, outputs);
}

// ---- main -------------------------------------------------------------------------------------

const std::map<std::string, kernels::SimdLevel>& SimdNames() {
  static const auto* names = new std::map<std::string, kernels::SimdLevel>{
      {"auto", kernels::SimdLevel::kAuto},
      {"scalar", kernels::SimdLevel::kScalar},
      {"avx2", kernels::SimdLevel::kAvx2},
      {"avx512", kernels::SimdLevel::kAvx512}};
  return *names;
}

std::string SimdName(kernels::SimdLevel level) {
  for (const auto& [name, l] : SimdNames()) {
    if (l == level) return name;
  }
  return "unknown";
}

int Main(int argc, char** argv) {
  CLI::App app{"quantd interop tool: quantd's CPU kernels and safetensors I/O for the pytest tier"};
  app.require_subcommand(1);
  std::string simd = "auto";
  app.add_option("--simd", simd, "CPU backend SIMD level")
      ->check(CLI::IsMember({"auto", "scalar", "avx2", "avx512"}));

  std::string in_path, out_path;
  std::vector<std::string> groups;
  std::optional<int> kmax;

  CLI::App* nvfp4 = app.add_subcommand("nvfp4", "NVFP4-quantize every 2-D BF16/F32 tensor");
  nvfp4->add_option("IN", in_path, "input safetensors file or checkpoint directory")->required();
  nvfp4->add_option("OUT", out_path, "output safetensors file")->required();
  nvfp4->add_option("--group", groups, "comma-separated tensors sharing one global amax");

  CLI::App* decode = app.add_subcommand("decode", "dequantize FP8-block and MXFP4 weights to F32");
  decode->add_option("IN", in_path, "input safetensors file or checkpoint directory")->required();
  decode->add_option("OUT", out_path, "output safetensors file")->required();

  CLI::App* cast = app.add_subcommand("mxfp4-to-nvfp4", "lossless MXFP4 -> NVFP4 cast");
  cast->add_option("IN", in_path, "input safetensors file or checkpoint directory")->required();
  cast->add_option("OUT", out_path, "output safetensors file")->required();
  cast->add_option("--kmax", kmax, "shared largest exponent (default: each tensor's own)");

  CLI::App* copy = app.add_subcommand("copy", "read every tensor and write it again");
  copy->add_option("IN", in_path, "input safetensors file")->required();
  copy->add_option("OUT", out_path, "output safetensors file")->required();

  CLI::App* act = app.add_subcommand("nvfp4-act", "NVFP4 activation fake-quantization");
  act->add_option("IN", in_path, "input safetensors file")->required();
  act->add_option("OUT", out_path, "output safetensors file")->required();

  CLI::App* levels = app.add_subcommand("simd-levels", "print the SIMD levels this CPU runs");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 1;  // --help is not an error; usage errors exit 1 like others
  }

  if (levels->parsed()) {
    for (kernels::SimdLevel l : kernels::SupportedSimdLevels()) printf("%s\n", SimdName(l).c_str());
    return 0;
  }
  absl::Status status;
  if (copy->parsed()) {
    status = RunCopy(in_path, out_path);
  } else if (act->parsed()) {
    status = RunNvfp4Act(in_path, out_path);
  } else {
    kernels::CpuOptions options;
    options.simd = SimdNames().at(simd);
    auto backend = kernels::MakeCpuBackend(options);
    if (!backend.ok()) {
      status = backend.status();
    } else if (nvfp4->parsed()) {
      status = RunNvfp4(**backend, in_path, out_path, groups);
    } else if (decode->parsed()) {
      status = RunDecode(**backend, in_path, out_path);
    } else {
      status = RunMxfp4ToNvfp4(**backend, in_path, out_path, kmax);
    }
  }
  if (!status.ok()) {
    fprintf(stderr, "quantd_interop_tool: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace quantd

int main(int argc, char** argv) { return quantd::Main(argc, argv); }
