#include "server/store/sqlite_db.h"

#include <errno.h>
#include <sqlite3.h>
#include <stdio.h>
#include <unistd.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/base/status_macros.h"
#include "server/store/private_files.h"

namespace quantd::store {
namespace {

constexpr int kBusyTimeoutMs = 5000;

absl::Status SqliteError(sqlite3* db, int rc, const std::string& what) {
  const char* msg = db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
  const std::string text = absl::StrCat(what, ": ", msg, " (sqlite code ", rc, ")");
  switch (rc & 0xFF) {
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
      return absl::UnavailableError(text);
    case SQLITE_CONSTRAINT:
      return absl::FailedPreconditionError(text);
    case SQLITE_CANTOPEN:
    case SQLITE_NOTADB:
    case SQLITE_CORRUPT:
      return absl::DataLossError(text);
    case SQLITE_FULL:
      return absl::ResourceExhaustedError(text);
    default:
      return absl::InternalError(text);
  }
}

}  // namespace

Statement::Statement(Statement&& other) noexcept { *this = std::move(other); }

Statement& Statement::operator=(Statement&& other) noexcept {
  if (this != &other) {
    if (stmt_ != nullptr) sqlite3_finalize(stmt_);
    db_ = std::exchange(other.db_, nullptr);
    stmt_ = std::exchange(other.stmt_, nullptr);
    bind_error_ = std::exchange(other.bind_error_, 0);
  }
  return *this;
}

Statement::~Statement() {
  if (stmt_ != nullptr) sqlite3_finalize(stmt_);
}

Statement& Statement::Bind(int index, int64_t value) {
  const int rc = sqlite3_bind_int64(stmt_, index, value);
  if (rc != SQLITE_OK && bind_error_ == 0) bind_error_ = rc;
  return *this;
}

Statement& Statement::Bind(int index, double value) {
  const int rc = sqlite3_bind_double(stmt_, index, value);
  if (rc != SQLITE_OK && bind_error_ == 0) bind_error_ = rc;
  return *this;
}

Statement& Statement::Bind(int index, const std::string& value) {
  const int rc = sqlite3_bind_text(stmt_, index, value.data(), static_cast<int>(value.size()),
                                   SQLITE_TRANSIENT);
  if (rc != SQLITE_OK && bind_error_ == 0) bind_error_ = rc;
  return *this;
}

Statement& Statement::Bind(int index, const char* value) { return Bind(index, std::string(value)); }

Statement& Statement::BindNull(int index) {
  const int rc = sqlite3_bind_null(stmt_, index);
  if (rc != SQLITE_OK && bind_error_ == 0) bind_error_ = rc;
  return *this;
}

Statement& Statement::Bind(int index, const std::optional<int64_t>& value) {
  return value.has_value() ? Bind(index, *value) : BindNull(index);
}

absl::StatusOr<bool> Statement::Step() {
  if (bind_error_ != 0) {
    return SqliteError(db_, bind_error_, absl::StrCat("binding ", sqlite3_sql(stmt_)));
  }
  const int rc = sqlite3_step(stmt_);
  if (rc == SQLITE_ROW) return true;
  if (rc == SQLITE_DONE) return false;
  return SqliteError(db_, rc, sqlite3_sql(stmt_));
}

absl::Status Statement::Run() {
  absl::StatusOr<bool> row = Step();
  if (!row.ok()) return row.status();
  return absl::OkStatus();
}

void Statement::Reset() {
  sqlite3_reset(stmt_);
  sqlite3_clear_bindings(stmt_);
  bind_error_ = 0;
}

int64_t Statement::ColumnInt(int col) const { return sqlite3_column_int64(stmt_, col); }

double Statement::ColumnDouble(int col) const { return sqlite3_column_double(stmt_, col); }

std::string Statement::ColumnText(int col) const {
  const unsigned char* text = sqlite3_column_text(stmt_, col);
  if (text == nullptr) return "";
  return std::string(reinterpret_cast<const char*>(text), sqlite3_column_bytes(stmt_, col));
}

bool Statement::ColumnIsNull(int col) const {
  return sqlite3_column_type(stmt_, col) == SQLITE_NULL;
}

std::optional<int64_t> Statement::ColumnOptionalInt(int col) const {
  if (ColumnIsNull(col)) return std::nullopt;
  return ColumnInt(col);
}

absl::StatusOr<std::unique_ptr<SqliteDb>> SqliteDb::OpenWithFlags(const std::string& path,
                                                                 int flags) {
  std::unique_ptr<SqliteDb> db(new SqliteDb());
  db->path_ = path;
  const int rc = sqlite3_open_v2(path.c_str(), &db->db_, flags | SQLITE_OPEN_NOMUTEX, nullptr);
  if (rc != SQLITE_OK) {
    absl::Status s = SqliteError(db->db_, rc, absl::StrCat("opening state database ", path));
    return s;
  }
  sqlite3_extended_result_codes(db->db_, 1);
  sqlite3_busy_timeout(db->db_, kBusyTimeoutMs);
  return db;
}

absl::StatusOr<std::unique_ptr<SqliteDb>> SqliteDb::Open(const std::string& path) {
  // Private (private_files.h): created 0600, an existing file made so. SQLite gives the -wal and
  // -shm files it creates the database's mode; ones a crash left behind are made private too.
  if (absl::Status s = CreatePrivateFile(path); !s.ok() && !absl::IsAlreadyExists(s)) {
    return absl::Status(s.code(), absl::StrCat("state database: ", s.message()));
  }
  for (const char* suffix : {"", "-wal", "-shm"}) {
    if (absl::StatusOr<bool> s = MakePrivate(path + suffix); !s.ok()) {
      return absl::Status(s.status().code(),
                          absl::StrCat("state database: ", s.status().message()));
    }
  }
  ASSIGN_OR_RETURN(std::unique_ptr<SqliteDb> db,
                   OpenWithFlags(path, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE));
  // journal_mode returns a row; Exec ignores rows. A file that is not a database fails here.
  if (absl::Status s = db->Exec("PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;"
                                " PRAGMA foreign_keys=ON;");
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("state database ", path, ": ", s.message()));
  }
  return db;
}

absl::StatusOr<std::unique_ptr<SqliteDb>> SqliteDb::OpenReadOnly(const std::string& path) {
  ASSIGN_OR_RETURN(std::unique_ptr<SqliteDb> db, OpenWithFlags(path, SQLITE_OPEN_READONLY));
  // The writer set WAL mode, which is persistent; a read-only connection cannot change it.
  return db;
}

SqliteDb::~SqliteDb() {
  if (db_ != nullptr) sqlite3_close_v2(db_);
}

absl::Status SqliteDb::Exec(const std::string& sql) {
  char* err = nullptr;
  const int rc = sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err);
  if (rc != SQLITE_OK) {
    absl::Status s = SqliteError(db_, rc, err != nullptr ? err : sql);
    sqlite3_free(err);
    return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<Statement> SqliteDb::Prepare(const std::string& sql) {
  sqlite3_stmt* stmt = nullptr;
  const int rc = sqlite3_prepare_v2(db_, sql.c_str(), static_cast<int>(sql.size()), &stmt, nullptr);
  if (rc != SQLITE_OK) return SqliteError(db_, rc, absl::StrCat("preparing ", sql));
  return Statement(db_, stmt);
}

absl::Status SqliteDb::RunTransaction(const char* begin, absl::FunctionRef<absl::Status()> body) {
  if (absl::Status s = Exec(begin); !s.ok()) return s;
  absl::Status result = body();
  if (result.ok()) result = Exec("COMMIT");
  if (!result.ok()) {
    // A failed COMMIT may already have rolled back; ROLLBACK then reports "no transaction".
    (void)Exec("ROLLBACK");
  }
  return result;
}

absl::Status SqliteDb::Transaction(absl::FunctionRef<absl::Status()> body) {
  return RunTransaction("BEGIN IMMEDIATE", body);
}

absl::Status SqliteDb::ReadTransaction(absl::FunctionRef<absl::Status()> body) {
  return RunTransaction("BEGIN", body);
}

absl::Status SqliteDb::QuickCheck() {
  absl::StatusOr<Statement> check = Prepare("PRAGMA quick_check(1)");
  absl::StatusOr<bool> row = check.ok() ? check->Step() : absl::StatusOr<bool>(check.status());
  if (!row.ok()) {
    return absl::DataLossError(absl::StrCat(path_, ": PRAGMA quick_check failed: ",
                                            row.status().message()));
  }
  const std::string verdict = *row ? check->ColumnText(0) : "no result";
  if (verdict == "ok") return absl::OkStatus();
  constexpr size_t kMaxShown = 200;  // SQLite's finding names pages and indexes, not data
  return absl::DataLossError(absl::StrCat(path_, ": PRAGMA quick_check found damage: ",
                                          verdict.substr(0, kMaxShown)));
}

absl::Status SqliteDb::BackupTo(const std::string& path) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  unlink(tmp.c_str());
  // VACUUM INTO writes into an empty file that exists: created private first.
  if (absl::Status s = CreatePrivateFile(tmp); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("backing up ", path_, ": ", s.message()));
  }
  absl::StatusOr<Statement> vacuum = Prepare("VACUUM INTO ?");
  if (!vacuum.ok()) return vacuum.status();
  vacuum->Bind(1, tmp);
  if (absl::Status s = vacuum->Run(); !s.ok()) {
    unlink(tmp.c_str());
    return absl::Status(s.code(), absl::StrCat("backing up ", path_, " to ", tmp, ": ",
                                               s.message()));
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return absl::ErrnoToStatus(err, absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

int64_t SqliteDb::LastInsertRowId() const { return sqlite3_last_insert_rowid(db_); }

int SqliteDb::Changes() const { return sqlite3_changes(db_); }

}  // namespace quantd::store
