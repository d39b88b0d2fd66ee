// RETURN_IF_ERROR and ASSIGN_OR_RETURN: the one way quantd propagates absl::Status.
//
//   RETURN_IF_ERROR(file.Sync());
//   ASSIGN_OR_RETURN(auto reader, SafetensorsReader::Open(path));
//   ASSIGN_OR_RETURN(header_, ParseHeader(bytes));   // assigns to an existing lvalue
//
// Both work in functions returning absl::Status or absl::StatusOr<T>. The expression is evaluated
// once; on error its status is returned unchanged (callers add context where they know more).
#ifndef QUANTD_SERVER_BASE_STATUS_MACROS_H_
#define QUANTD_SERVER_BASE_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define QUANTD_STATUS_CONCAT_INNER_(a, b) a##b
#define QUANTD_STATUS_CONCAT_(a, b) QUANTD_STATUS_CONCAT_INNER_(a, b)

#define RETURN_IF_ERROR(expr)                                   \
  do {                                                          \
    if (absl::Status quantd_status_ = (expr); !quantd_status_.ok()) \
      return quantd_status_;                                    \
  } while (0)

#define ASSIGN_OR_RETURN(lhs, expr) \
  QUANTD_ASSIGN_OR_RETURN_IMPL_(QUANTD_STATUS_CONCAT_(quantd_statusor_, __LINE__), lhs, expr)

#define QUANTD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

#endif  // QUANTD_SERVER_BASE_STATUS_MACROS_H_
