#include "server/store/migrations.h"

#include "absl/strings/str_cat.h"

namespace quantd::store {

absl::StatusOr<int> ApplyMigrations(SqliteDb& db, const std::vector<Migration>& migrations) {
  for (size_t i = 0; i < migrations.size(); ++i) {
    if (migrations[i].version != static_cast<int>(i) + 1) {
      return absl::InternalError(absl::StrCat("migration ", migrations[i].name, " has version ",
                                              migrations[i].version, ", expected ", i + 1));
    }
  }
  const int latest = static_cast<int>(migrations.size());
  int version = 0;
  // A migration may rebuild a table (SQLite's way to change a constraint), which with foreign keys
  // on would cascade-delete the rows referring to it. The pragma is a no-op inside a transaction,
  // so it is switched off around it; the references are checked before the commit instead.
  if (absl::Status s = db.Exec("PRAGMA foreign_keys=OFF"); !s.ok()) return s;
  absl::Status status = db.Transaction([&]() -> absl::Status {
    absl::StatusOr<Statement> get = db.Prepare("PRAGMA user_version");
    if (!get.ok()) return get.status();
    absl::StatusOr<bool> row = get->Step();
    if (!row.ok()) return row.status();
    version = static_cast<int>(get->ColumnInt(0));
    get->Reset();  // a statement still stepping would lock the tables a migration rebuilds
    if (version > latest) {
      return absl::FailedPreconditionError(absl::StrCat(
          "state database ", db.path(), " has schema version ", version,
          ", newer than this quantd knows (", latest, "); use a newer quantd"));
    }
    for (int v = version + 1; v <= latest; ++v) {
      const Migration& m = migrations[v - 1];
      if (absl::Status s = db.Exec(m.sql); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("migration ", m.name, ": ", s.message()));
      }
    }
    absl::StatusOr<Statement> check = db.Prepare("PRAGMA foreign_key_check");
    if (!check.ok()) return check.status();
    absl::StatusOr<bool> dangling = check->Step();
    if (!dangling.ok()) return dangling.status();
    if (*dangling) {
      return absl::InternalError(absl::StrCat("state database ", db.path(),
                                              ": migration left a row of table ",
                                              check->ColumnText(0), " without its parent"));
    }
    check->Reset();
    return db.Exec(absl::StrCat("PRAGMA user_version=", latest));
  });
  if (absl::Status s = db.Exec("PRAGMA foreign_keys=ON"); !s.ok() && status.ok()) return s;
  if (!status.ok()) return status;
  return latest;
}

}  // namespace quantd::store
