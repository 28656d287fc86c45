// Status propagation macros. Abseil 20220623 (Debian 12) has Status/StatusOr but no
// status macros, so the project keeps these two.
//
//   RETURN_IF_ERROR(comm->Barrier());
//   ASSIGN_OR_RETURN(Tensor t, ReadTensor(path));
#ifndef MOED_ENGINE_STATUS_MACROS_H_
#define MOED_ENGINE_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MOED_CONCAT_INNER(a, b) a##b
#define MOED_CONCAT(a, b) MOED_CONCAT_INNER(a, b)

#define RETURN_IF_ERROR(expr)                              \
  do {                                                     \
    const ::absl::Status _moed_status = (expr);            \
    if (!_moed_status.ok()) return _moed_status;           \
  } while (0)

#define ASSIGN_OR_RETURN(lhs, expr) \
  MOED_ASSIGN_OR_RETURN_IMPL(MOED_CONCAT(_moed_statusor_, __LINE__), lhs, expr)

#define MOED_ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr) \
  auto statusor = (expr);                               \
  if (!statusor.ok()) return statusor.status();         \
  lhs = std::move(statusor).value()

#endif  // MOED_ENGINE_STATUS_MACROS_H_
