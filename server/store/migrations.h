// Schema migrations: numbered SQL scripts (migrations/NNNN_name.sql, embedded into the binary at
// build time) applied in order inside one IMMEDIATE transaction, with PRAGMA user_version
// recording the last one applied. Foreign keys are off while they run (a migration may rebuild a
// table) and every reference is checked before the commit.
#ifndef QUANTD_SERVER_STORE_MIGRATIONS_H_
#define QUANTD_SERVER_STORE_MIGRATIONS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/store/sqlite_db.h"

namespace quantd::store {

struct Migration {
  int version;       // NNNN of the file name; versions are 1, 2, 3, ... without gaps
  std::string name;  // file name, for errors
  std::string sql;   // the script
};

// The migrations compiled into this binary, in version order.
const std::vector<Migration>& BuiltinMigrations();

// Brings the database to the newest version in `migrations`. Refuses (FailedPrecondition) a
// database whose user_version is newer than the newest migration, and a migration list with gaps.
// On any failure nothing is applied. Returns the resulting version.
absl::StatusOr<int> ApplyMigrations(SqliteDb& db, const std::vector<Migration>& migrations);

}  // namespace quantd::store

#endif  // QUANTD_SERVER_STORE_MIGRATIONS_H_
