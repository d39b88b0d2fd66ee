#include "server/checkpoint/safetensors_reader.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <limits>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/base/excerpt.h"
#include "server/base/status_macros.h"
#include "server/checkpoint/atomic_file.h"
#include "server/checkpoint/json_file.h"
#include "server/checkpoint/mapped_region_guard.h"
#include "server/checkpoint/sha256.h"

namespace quantd::checkpoint {
namespace {

using nlohmann::json;

// The 8-byte little-endian header length that starts every file.
constexpr uint64_t kLengthBytes = 8;
// A JSON value as text for an error message, cut short when long.
std::string Shown(const json& value) {
  std::string text = value.dump();
  if (text.size() > base::kMaxExcerptBytes) {
    text = absl::StrCat(text.substr(0, base::kMaxExcerptBytes), "...");
  }
  return text;
}

absl::Status FileError(const std::string& path, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", message));
}

absl::Status TensorError(const std::string& path, const std::string& tensor,
                         absl::string_view message) {
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": tensor ", base::Excerpt(tensor), ": ", message));
}

// Records the first key that appears twice in one JSON object (nlohmann keeps only one of them).
class DuplicateKeyFinder {
 public:
  bool OnEvent(json::parse_event_t event, const json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        open_objects_.emplace_back();
        break;
      case json::parse_event_t::object_end:
        open_objects_.pop_back();
        break;
      case json::parse_event_t::key:
        if (!found_ && !open_objects_.back().insert(parsed.get<std::string>()).second) {
          found_ = true;
          duplicate_ = parsed.get<std::string>();
          at_top_level_ = open_objects_.size() == 1;
        }
        break;
      default:
        break;
    }
    return true;
  }

  bool found() const { return found_; }
  const std::string& duplicate() const { return duplicate_; }
  bool at_top_level() const { return at_top_level_; }

 private:
  std::vector<std::set<std::string>> open_objects_;  // keys seen so far in each open object
  bool found_ = false;                                 // a duplicate was seen
  std::string duplicate_;                              // the first duplicate key
  bool at_top_level_ = false;                          // it was a tensor name (depth 1)
};

// A JSON value that is an integer in [0, max].
bool IsUnsignedAtMost(const json& v, uint64_t max) {
  return v.is_number_unsigned() && v.get<uint64_t>() <= max;
}

// Checks one tensor entry and fills `view` (offset relative to the data section; data unset).
absl::Status ParseEntry(const std::string& path, const std::string& name, const json& entry,
                        uint64_t data_size, TensorView* view) {
  if (!entry.is_object()) return TensorError(path, name, "entry is not a JSON object");
  for (auto it = entry.begin(); it != entry.end(); ++it) {
    if (it.key() != "dtype" && it.key() != "shape" && it.key() != "data_offsets") {
      return TensorError(path, name, absl::StrCat("unexpected field ", base::Excerpt(it.key())));
    }
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(field)) {
      return TensorError(path, name, absl::StrCat("missing field \"", field, "\""));
    }
  }

  const json& dtype = entry["dtype"];
  if (!dtype.is_string()) return TensorError(path, name, "dtype is not a string");
  std::optional<Dtype> parsed_dtype = ParseDtype(dtype.get_ref<const std::string&>());
  if (!parsed_dtype) {
    return TensorError(path, name,
                       absl::StrCat("unknown dtype ", base::Excerpt(dtype.get<std::string>())));
  }

  const json& shape = entry["shape"];
  if (!shape.is_array()) return TensorError(path, name, "shape is not an array");
  // Every partial product must fit int64_t, so that TensorView::numel() cannot overflow.
  int64_t numel = 1;
  for (const json& dim : shape) {
    if (!IsUnsignedAtMost(dim, std::numeric_limits<int64_t>::max())) {
      return TensorError(path, name,
                         absl::StrCat("shape ", Shown(shape), " is not a list of non-negative "
                                      "integers"));
    }
    int64_t d = dim.get<int64_t>();
    view->shape.push_back(d);
    if (__builtin_mul_overflow(numel, d, &numel)) {
      return TensorError(path, name, absl::StrCat("shape ", Shown(shape), " overflows 64 bits"));
    }
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(numel), DtypeSize(*parsed_dtype), &bytes)) {
    return TensorError(path, name, absl::StrCat("shape ", Shown(shape), " overflows 64 bits"));
  }

  const json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 ||
      !IsUnsignedAtMost(offsets[0], std::numeric_limits<uint64_t>::max()) ||
      !IsUnsignedAtMost(offsets[1], std::numeric_limits<uint64_t>::max())) {
    return TensorError(path, name,
                       absl::StrCat("data_offsets ", Shown(offsets),
                                    " is not a pair of non-negative integers"));
  }
  uint64_t begin = offsets[0].get<uint64_t>();
  uint64_t end = offsets[1].get<uint64_t>();
  if (begin > end) {
    return TensorError(path, name,
                       absl::StrCat("data_offsets [", begin, ", ", end, "] end before they begin"));
  }
  if (end > data_size) {
    return TensorError(path, name,
                       absl::StrCat("data_offsets [", begin, ", ", end, "] run past the end of "
                                    "the file (data section is ", data_size, " bytes)"));
  }
  if (end - begin != bytes) {
    return TensorError(path, name,
                       absl::StrCat(std::string(DtypeName(*parsed_dtype)), " shape ", Shown(shape), " needs ",
                                    bytes, " bytes but data_offsets [", begin, ", ", end,
                                    "] hold ", end - begin));
  }
  view->name = name;
  view->dtype = *parsed_dtype;
  view->offset = begin;
  view->size = bytes;
  return absl::OkStatus();
}

absl::Status ParseMetadata(const std::string& path, const json& value,
                           std::map<std::string, std::string>* metadata) {
  if (!value.is_object()) return FileError(path, "__metadata__ is not a JSON object");
  for (const auto& [key, v] : value.items()) {
    if (!v.is_string()) {
      return FileError(
          path, absl::StrCat("__metadata__ value for ", base::Excerpt(key), " is not a string"));
    }
    (*metadata)[key] = v.get<std::string>();
  }
  return absl::OkStatus();
}

}  // namespace

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path,
                                                                       const SourceRoots& roots) {
  struct stat st;
  absl::StatusOr<int> fd = OpenRegularFile(path, /*follow_symlink=*/true, &st, roots);
  if (!fd.ok()) return fd.status();
  return FromDescriptor(path, *fd, st);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const DirHandle& dir,
                                                                       absl::string_view rel) {
  struct stat st;
  absl::StatusOr<int> fd = dir.OpenRegularFile(rel, &st);
  if (!fd.ok()) return fd.status();
  return FromDescriptor(dir.PathOf(rel), *fd, st);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromDescriptor(
    std::string path, int fd, const struct stat& st) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = std::move(path);
  file->size_ = static_cast<uint64_t>(st.st_size);
  // Parse() rejects files too short to hold the length prefix; an empty file cannot be mapped.
  if (file->size_ >= kLengthBytes) {
    void* mapping = mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapping == MAP_FAILED) {
      int err = errno;
      close(fd);
      return absl::ErrnoToStatus(err, absl::StrCat(file->path_, ": mmap failed"));
    }
    file->base_ = static_cast<const uint8_t*>(mapping);
    file->mapped_ = true;
    absl::StatusOr<int> slot = RegisterMappedRegion(mapping, file->size_);
    if (!slot.ok()) {
      close(fd);
      return absl::Status(slot.status().code(),
                          absl::StrCat(file->path_, ": ", slot.status().message()));
    }
    file->guard_slot_ = *slot;
  }
  close(fd);
  absl::Status status = file->Parse();
  if (!status.ok()) return status;
  if (absl::Status intact = file->CheckIntact(); !intact.ok()) return intact;
  return file;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromBytes(std::string name,
                                                                            const uint8_t* bytes,
                                                                            uint64_t size) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = std::move(name);
  file->base_ = bytes;
  file->size_ = size;
  absl::Status status = file->Parse();
  if (!status.ok()) return status;
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (guard_slot_ >= 0) UnregisterMappedRegion(guard_slot_);
  if (mapped_) munmap(const_cast<uint8_t*>(base_), size_);
}

absl::Status SafetensorsFile::CheckIntact() const {
  if (guard_slot_ < 0 || !MappedRegionFaulted(guard_slot_)) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(
      path_, ": the file shrank below its ", size_,
      " bytes while it was being read (truncated or replaced in place); what was read from it "
      "cannot be trusted"));
}

const TensorView* SafetensorsFile::Find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

absl::Status SafetensorsFile::Parse() {
  if (size_ < kLengthBytes) {
    return FileError(path_, absl::StrCat("file is ", size_,
                                         " bytes, too short for the 8-byte header length"));
  }
  uint64_t header_len = 0;
  for (uint64_t i = 0; i < kLengthBytes; ++i) {
    header_len |= static_cast<uint64_t>(base_[i]) << (8 * i);
  }
  if (header_len > kMaxHeaderBytes) {
    return FileError(path_, absl::StrCat("header length ", header_len, " exceeds the limit of ",
                                         kMaxHeaderBytes, " bytes"));
  }
  if (header_len > size_ - kLengthBytes) {
    return FileError(path_, absl::StrCat("header length ", header_len, " runs past the end of the ",
                                         size_, "-byte file"));
  }
  const uint8_t* header = base_ + kLengthBytes;
  if (header_len == 0 || header[0] != '{') {
    return FileError(path_, "header does not start with '{'");
  }
  if (JsonNestingExceeds(header, header_len, kMaxJsonDepth)) {
    return FileError(path_, absl::StrCat("header JSON nests deeper than ", kMaxJsonDepth));
  }

  DuplicateKeyFinder duplicates;
  json root;
  try {
    root = json::parse(header, header + header_len,
                       [&duplicates](int /*depth*/, json::parse_event_t event, json& parsed) {
                         return duplicates.OnEvent(event, parsed);
                       });
  } catch (const json::parse_error& e) {
    // e.what() quotes the text near the error; the offset is enough and quotes nothing.
    return FileError(path_, absl::StrCat("header is not valid JSON (syntax error at byte ",
                                         kLengthBytes + e.byte, ")"));
  } catch (const json::exception& e) {
    return FileError(path_, "header is not valid JSON");
  }
  if (duplicates.found()) {
    return FileError(
        path_, absl::StrCat(duplicates.at_top_level() ? "duplicate tensor name " : "duplicate key ",
                            base::Excerpt(duplicates.duplicate()), " in header"));
  }
  if (!root.is_object()) return FileError(path_, "header is not a JSON object");

  const uint64_t data_start = kLengthBytes + header_len;
  const uint64_t data_size = size_ - data_start;
  for (const auto& [name, entry] : root.items()) {
    if (name == "__metadata__") {
      absl::Status status = ParseMetadata(path_, entry, &metadata_);
      if (!status.ok()) return status;
      continue;
    }
    TensorView view;
    absl::Status status = ParseEntry(path_, name, entry, data_size, &view);
    if (!status.ok()) return status;
    tensors_.push_back(std::move(view));
  }

  // The byte ranges, in offset order, must tile the data section exactly.
  std::sort(tensors_.begin(), tensors_.end(), [](const TensorView& a, const TensorView& b) {
    return std::tie(a.offset, a.size, a.name) < std::tie(b.offset, b.size, b.name);
  });
  uint64_t covered = 0;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const TensorView& t = tensors_[i];
    if (t.offset < covered) {
      return TensorError(path_, t.name,
                         absl::StrCat("data_offsets [", t.offset, ", ", t.offset + t.size,
                                      "] overlap tensor ", base::Excerpt(tensors_[i - 1].name)));
    }
    if (t.offset > covered) {
      return TensorError(path_, t.name,
                         absl::StrCat("data_offsets [", t.offset, ", ", t.offset + t.size,
                                      "] leave a gap: no tensor holds bytes [", covered, ", ",
                                      t.offset, ")"));
    }
    covered = t.offset + t.size;
  }
  if (covered != data_size) {
    return FileError(path_, absl::StrCat("tensors cover ", covered, " bytes but the data section "
                                         "holds ", data_size));
  }

  for (size_t i = 0; i < tensors_.size(); ++i) {
    TensorView& t = tensors_[i];
    t.offset += data_start;
    t.data = base_ + t.offset;
    by_name_.emplace(t.name, i);
  }
  return absl::OkStatus();
}

void SafetensorsFile::ReleasePages(const TensorView& view) const {
  ReleaseRange(view.data, view.size);
}

void SafetensorsFile::ReleaseRange(const uint8_t* data, uint64_t size) const {
  if (!mapped_ || data < base_ || data + size > base_ + size_) return;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + size) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

absl::StatusOr<std::string> SafetensorsFile::Sha256(
    const std::function<absl::Status(uint64_t)>& on_chunk) const {
  constexpr uint64_t kChunkBytes = 64ull << 20;
  checkpoint::Sha256 hash;
  for (uint64_t done = 0; done < size_;) {
    const uint64_t n = std::min(kChunkBytes, size_ - done);
    hash.Update(base_ + done, n);
    ReleaseRange(base_ + done, n);
    done += n;
    if (on_chunk) RETURN_IF_ERROR(on_chunk(n));
  }
  RETURN_IF_ERROR(CheckIntact());
  return hash.HexDigest();
}

}  // namespace quantd::checkpoint
