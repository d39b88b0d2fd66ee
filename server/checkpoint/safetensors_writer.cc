#include "server/checkpoint/safetensors_writer.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include <set>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/atomic_file.h"

namespace quantd::checkpoint {
namespace {

using nlohmann::ordered_json;

// Appends smaller than this are gathered; the buffer is written out whole.
constexpr size_t kBufferBytes = 8 << 20;

// nlohmann refuses to serialize strings that are not UTF-8.
bool IsUtf8(const std::string& s) {
  try {
    ordered_json(s).dump();
    return true;
  } catch (const ordered_json::exception&) {
    return false;
  }
}

absl::Status CheckSpec(const std::string& path, const TensorSpec& spec) {
  auto error = [&](absl::string_view message) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": tensor \"", spec.name, "\": ", message));
  };
  if (spec.name.empty()) return error("empty tensor name");
  if (spec.name == "__metadata__") return error("\"__metadata__\" is reserved");
  if (!IsUtf8(spec.name)) return error("name is not valid UTF-8");
  int64_t numel = 1;
  for (int64_t d : spec.shape) {
    if (d < 0) return error(absl::StrCat("negative dimension ", d));
    if (__builtin_mul_overflow(numel, d, &numel)) return error("shape overflows 64 bits");
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(numel), DtypeSize(spec.dtype), &bytes)) {
    return error("shape overflows 64 bits");
  }
  return absl::OkStatus();
}

// The JSON header, tensors in declaration order, padded with spaces to a multiple of 8 bytes.
std::string HeaderText(const std::vector<TensorSpec>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  ordered_json header = ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const TensorSpec& t : tensors) {
    ordered_json entry = ordered_json::object();
    entry["dtype"] = std::string(DtypeName(t.dtype));
    entry["shape"] = t.shape;
    entry["data_offsets"] = {offset, offset + t.bytes()};
    header[t.name] = std::move(entry);
    offset += t.bytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

}  // namespace

uint64_t TensorSpec::bytes() const {
  uint64_t n = DtypeSize(dtype);
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    std::string path, std::vector<TensorSpec> tensors,
    std::map<std::string, std::string> metadata) {
  return CreateIn(nullptr, std::move(path), std::move(tensors), std::move(metadata));
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const DirHandle& dir, std::string name, std::vector<TensorSpec> tensors,
    std::map<std::string, std::string> metadata) {
  return CreateIn(&dir, std::move(name), std::move(tensors), std::move(metadata));
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::CreateIn(
    const DirHandle* dir, std::string name, std::vector<TensorSpec> tensors,
    std::map<std::string, std::string> metadata) {
  std::string path = dir != nullptr ? dir->PathOf(name) : name;
  std::set<std::string> names;
  for (const TensorSpec& t : tensors) {
    absl::Status status = CheckSpec(path, t);
    if (!status.ok()) return status;
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor \"", t.name, "\" declared twice"));
    }
  }
  for (const auto& [key, value] : metadata) {
    if (!IsUtf8(key) || !IsUtf8(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": __metadata__ entry for \"", key, "\" is not valid UTF-8"));
    }
  }

  std::string header = HeaderText(tensors, metadata);
  std::unique_ptr<SafetensorsWriter> writer(new SafetensorsWriter());
  writer->path_ = std::move(path);
  writer->dir_ = dir;
  writer->name_ = std::move(name);
  writer->tmp_path_ = absl::StrCat(writer->path_, ".tmp");
  writer->header_bytes_ = 8 + header.size();
  for (const TensorSpec& t : tensors) writer->data_bytes_ += t.bytes();
  writer->tensors_ = std::move(tensors);

  if (absl::Status s = writer->CreateTmp(); !s.ok()) return s;
  // From here on the destructor removes the .tmp file on failure.
  // Reserve the whole file so that a full disk fails now, not after gigabytes were written.
  if (fallocate(writer->fd_, 0, 0, static_cast<off_t>(writer->total_bytes())) != 0 &&
      errno != EOPNOTSUPP && errno != ENOSYS) {
    return absl::ErrnoToStatus(errno, absl::StrCat(writer->tmp_path_, ": cannot reserve ",
                                                   writer->total_bytes(), " bytes"));
  }

  writer->buffer_.reserve(kBufferBytes);
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(header.size() >> (8 * i));
  writer->buffer_.insert(writer->buffer_.end(), length, length + 8);
  writer->buffer_.insert(writer->buffer_.end(), header.begin(), header.end());
  writer->SkipCompleteTensors();
  return writer;
}

absl::Status SafetensorsWriter::CreateTmp() {
  absl::StatusOr<int> fd = dir_ != nullptr ? dir_->CreateForWrite(name_ + ".tmp")
                                           : CreateForWrite(tmp_path_);
  if (!fd.ok()) return fd.status();
  fd_ = *fd;
  return absl::OkStatus();
}

void SafetensorsWriter::RemoveTmp() {
  if (dir_ != nullptr) {
    dir_->Remove(name_ + ".tmp").IgnoreError();
  } else {
    unlink(tmp_path_.c_str());
  }
}

absl::Status SafetensorsWriter::CommitTmp() {
  return dir_ != nullptr ? dir_->Rename(name_ + ".tmp", name_) : CommitTmpFile(tmp_path_, path_);
}

SafetensorsWriter::~SafetensorsWriter() {
  WaitForHash();
  if (fd_ >= 0) {
    close(fd_);
    RemoveTmp();
  }
}

void SafetensorsWriter::SkipCompleteTensors() {
  while (current_ < tensors_.size() && written_in_current_ == tensors_[current_].bytes()) {
    ++current_;
    written_in_current_ = 0;
  }
}

void SafetensorsWriter::WaitForHash() {
  if (hashing_.valid()) hashing_.get();
}

absl::Status SafetensorsWriter::Flush() {
  WaitForHash();  // flushed_ is free again, and hash_ has every byte before buffer_'s
  flushed_.swap(buffer_);
  buffer_.clear();
  hashing_ = std::async(std::launch::async,
                        [this] { hash_.Update(flushed_.data(), flushed_.size()); });
  return WriteFully(fd_, flushed_.data(), flushed_.size(), tmp_path_);
}

absl::Status SafetensorsWriter::WriteHashed(const void* data, uint64_t size) {
  // Hashed here, before the write: `data` may be a mapped source shard, and a page of it that a
  // truncation took away must fault in a read (checkpoint/mapped_region_guard.h absorbs it and
  // the caller reports the shrunken file), not fail inside write() with EFAULT.
  WaitForHash();
  hash_.Update(data, size);
  return WriteFully(fd_, data, size, tmp_path_);
}

absl::Status SafetensorsWriter::Abandon(absl::Status status) {
  WaitForHash();
  close(fd_);
  fd_ = -1;
  RemoveTmp();
  return status;
}

absl::Status SafetensorsWriter::Closed() const {
  return absl::FailedPreconditionError(
      absl::StrCat(path_, finished_ ? ": writer already finished" : ": writer failed earlier"));
}

absl::Status SafetensorsWriter::Append(const void* data, uint64_t size) {
  if (fd_ < 0) return Closed();
  if (size == 0) return absl::OkStatus();
  if (current_ == tensors_.size()) {
    return absl::OutOfRangeError(
        absl::StrCat(path_, ": ", size, " bytes appended after the last tensor"));
  }
  const TensorSpec& t = tensors_[current_];
  if (size > t.bytes() - written_in_current_) {
    return absl::OutOfRangeError(absl::StrCat(
        path_, ": tensor \"", t.name, "\": appending ", size, " bytes after ",
        written_in_current_, " would exceed its ", t.bytes(), " bytes"));
  }
  absl::Status status;
  if (buffer_.size() + size > kBufferBytes) status = Flush();
  if (status.ok()) {
    if (size >= kBufferBytes) {
      status = WriteHashed(data, size);
    } else {
      const uint8_t* bytes = static_cast<const uint8_t*>(data);
      buffer_.insert(buffer_.end(), bytes, bytes + size);
    }
  }
  if (!status.ok()) return Abandon(status);
  written_in_current_ += size;
  SkipCompleteTensors();
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::WriteTensor(const std::string& name, const void* data,
                                            uint64_t size) {
  bool is_current = current_ < tensors_.size() && tensors_[current_].name == name;
  const TensorSpec* spec = is_current ? &tensors_[current_] : nullptr;
  for (size_t i = 0; spec == nullptr && i < tensors_.size(); ++i) {
    if (tensors_[i].name == name) spec = &tensors_[i];
  }
  if (spec == nullptr) {
    return absl::NotFoundError(absl::StrCat(path_, ": tensor \"", name, "\" was not declared"));
  }
  if (size != spec->bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor \"", name, "\": ", size,
                                                   " bytes given, ", spec->bytes(), " declared"));
  }
  // A zero-byte tensor adds nothing to the file, so it is never out of order.
  if (size == 0) return absl::OkStatus();
  if (is_current && written_in_current_ != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        path_, ": tensor \"", name, "\" already has ", written_in_current_, " bytes appended"));
  }
  if (!is_current) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": tensor \"", name, "\" written out of order; next due is \"",
                     NextTensor(), "\""));
  }
  return Append(data, size);
}

std::string SafetensorsWriter::NextTensor() const {
  return current_ < tensors_.size() ? tensors_[current_].name : std::string();
}

uint64_t SafetensorsWriter::total_bytes() const { return header_bytes_ + data_bytes_; }

absl::Status SafetensorsWriter::Finish() {
  if (fd_ < 0) return Closed();
  if (current_ < tensors_.size()) {
    const TensorSpec& t = tensors_[current_];
    return Abandon(absl::FailedPreconditionError(
        absl::StrCat(path_, ": tensor \"", t.name, "\" incomplete: ", written_in_current_, " of ",
                     t.bytes(), " bytes written")));
  }
  absl::Status status = Flush();
  if (!status.ok()) return Abandon(status);
  WaitForHash();
  sha256_ = hash_.HexDigest();
  status = SyncAndClose(fd_, tmp_path_);
  fd_ = -1;
  if (status.ok()) status = CommitTmp();
  if (!status.ok()) {
    RemoveTmp();
    sha256_.clear();
    return status;
  }
  finished_ = true;
  return absl::OkStatus();
}

}  // namespace quantd::checkpoint
