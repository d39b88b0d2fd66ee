#include "server/calibration/activation_store.h"

#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace quantd::calibration {
namespace {

constexpr char kSpillPrefix[] = "spill-";

// Removes a spill directory: the spill files (and their .tmp) in it, then the directory.
void RemoveSpillDir(const std::filesystem::path& dir) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_symlink() && entry.is_regular_file() && absl::StartsWith(name, "layer")) {
      std::filesystem::remove(entry.path(), ec);
    }
  }
  std::filesystem::remove(dir, ec);  // fails harmlessly when something else is in it
}

}  // namespace

absl::StatusOr<std::unique_ptr<ActivationStore>> ActivationStore::Create(
    const std::string& work_dir, int64_t host_budget_bytes) {
  static std::atomic<int64_t> next{0};
  if (work_dir.empty()) {
    return std::unique_ptr<ActivationStore>(new ActivationStore("", INT64_MAX));
  }
  std::error_code ec;
  std::filesystem::create_directories(work_dir, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot create ", work_dir, ": ", ec.message()));
  }
  for (const auto& entry : std::filesystem::directory_iterator(work_dir, ec)) {
    if (!entry.is_symlink() && entry.is_directory() &&
        absl::StartsWith(entry.path().filename().string(), kSpillPrefix)) {
      RemoveSpillDir(entry.path());
    }
  }
  const std::string dir = (std::filesystem::path(work_dir) /
                           absl::StrCat(kSpillPrefix, getpid(), "-", next.fetch_add(1)))
                              .string();
  std::filesystem::create_directory(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  return std::unique_ptr<ActivationStore>(new ActivationStore(dir, host_budget_bytes));
}

ActivationStore::~ActivationStore() {
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, output] : outputs_) Drop(output);
    outputs_.clear();
  }
  if (!spill_dir_.empty()) RemoveSpillDir(spill_dir_);
}

bool ActivationStore::ReserveHost(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (!spill_dir_.empty() && bytes > budget_ - reserved_) return false;
  reserved_ += bytes;
  peak_ = std::max(peak_, reserved_);
  return true;
}

void ActivationStore::UnreserveHost(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  reserved_ -= bytes;
}

void ActivationStore::Put(int64_t layer, int64_t slice, Batches batches) {
  Store(layer, slice, {std::make_shared<const Batches>(std::move(batches)), true});
}

void ActivationStore::PutCheckpointed(int64_t layer, int64_t slice, Batches batches) {
  Store(layer, slice, {std::make_shared<const Batches>(std::move(batches)), false});
}

void ActivationStore::Store(int64_t layer, int64_t slice, Output output) {
  absl::MutexLock lock(&mu_);
  Output& slot = outputs_[{layer, slice}];
  if (slot.batches != nullptr) Drop(slot);
  slot = std::move(output);
}

std::shared_ptr<const ActivationStore::Batches> ActivationStore::Get(int64_t layer,
                                                                     int64_t slice) const {
  absl::MutexLock lock(&mu_);
  auto it = outputs_.find({layer, slice});
  return it == outputs_.end() ? nullptr : it->second.batches;
}

void ActivationStore::ReleaseLayer(int64_t layer) {
  absl::MutexLock lock(&mu_);
  for (auto it = outputs_.lower_bound({layer, INT64_MIN});
       it != outputs_.end() && it->first.first == layer;) {
    Drop(it->second);
    it = outputs_.erase(it);
  }
}

void ActivationStore::Drop(const Output& output) {
  for (const BatchActivations& b : *output.batches) {
    if (b.spill_path.empty()) {
      reserved_ -= HostBytes(b.host);
    } else if (output.owns_files) {
      ::remove(b.spill_path.c_str());
    }
  }
}

int64_t ActivationStore::host_bytes() const {
  absl::MutexLock lock(&mu_);
  return reserved_;
}

int64_t ActivationStore::peak_host_bytes() const {
  absl::MutexLock lock(&mu_);
  return peak_;
}

}  // namespace quantd::calibration
