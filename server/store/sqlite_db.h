// A SQLite connection with quantd's settings, prepared statements and IMMEDIATE transactions.
//
// Settings applied on open: WAL journal, synchronous=FULL (every commit is durable before it
// returns), foreign keys enforced, a busy timeout. quantd uses one writer connection owned by one
// thread (see ../shared/reference/service_ecosystem.md §2.3 on the WAL-reset bug in 3.40).
#ifndef QUANTD_SERVER_STORE_SQLITE_DB_H_
#define QUANTD_SERVER_STORE_SQLITE_DB_H_

#include <stdint.h>

#include <memory>
#include <optional>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

struct sqlite3;
struct sqlite3_stmt;

namespace quantd::store {

// One prepared statement. Parameters are 1-based as in SQLite; columns are 0-based.
class Statement {
 public:
  Statement(Statement&& other) noexcept;
  Statement& operator=(Statement&& other) noexcept;
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;
  ~Statement();

  Statement& Bind(int index, int64_t value);
  Statement& Bind(int index, double value);
  Statement& Bind(int index, const std::string& value);
  Statement& Bind(int index, const char* value);
  Statement& BindNull(int index);
  // Binds value or NULL.
  Statement& Bind(int index, const std::optional<int64_t>& value);

  // Advances: true when a row is available, false when done. Reports bind errors too.
  absl::StatusOr<bool> Step();
  // Runs a statement that returns no rows.
  absl::Status Run();
  // Clears the result and the bindings so the statement can run again.
  void Reset();

  int64_t ColumnInt(int col) const;
  double ColumnDouble(int col) const;
  std::string ColumnText(int col) const;
  bool ColumnIsNull(int col) const;
  std::optional<int64_t> ColumnOptionalInt(int col) const;

 private:
  friend class SqliteDb;
  Statement(sqlite3* db, sqlite3_stmt* stmt) : db_(db), stmt_(stmt) {}

  sqlite3* db_ = nullptr;        // owning connection, for error messages
  sqlite3_stmt* stmt_ = nullptr;  // the statement; finalized on destruction
  int bind_error_ = 0;           // first failing sqlite3_bind_* result, reported by Step()
};

class SqliteDb {
 public:
  // Opens (creating if needed) the database file at `path` and applies the settings above. The
  // file and its -wal and -shm are private (private_files.h): created 0600, made so if they exist.
  static absl::StatusOr<std::unique_ptr<SqliteDb>> Open(const std::string& path);
  // Opens an existing database for reading only, beside the writer: WAL lets it read a committed
  // snapshot while the writer commits. Its writes fail (SQLITE_READONLY).
  static absl::StatusOr<std::unique_ptr<SqliteDb>> OpenReadOnly(const std::string& path);
  ~SqliteDb();
  SqliteDb(const SqliteDb&) = delete;
  SqliteDb& operator=(const SqliteDb&) = delete;

  const std::string& path() const { return path_; }
  // Runs one or more statements that return no rows.
  absl::Status Exec(const std::string& sql);
  absl::StatusOr<Statement> Prepare(const std::string& sql);
  // BEGIN IMMEDIATE; body; COMMIT. Rolls back when body fails and returns its status. Not
  // reentrant.
  absl::Status Transaction(absl::FunctionRef<absl::Status()> body);
  // BEGIN (deferred); body; COMMIT: every read of `body` sees the same committed snapshot. The
  // transaction of a read-only connection. Not reentrant.
  absl::Status ReadTransaction(absl::FunctionRef<absl::Status()> body);
  // PRAGMA quick_check: DataLoss naming the file and SQLite's first finding when the pages or
  // indexes are damaged.
  absl::Status QuickCheck();
  // Writes a consistent copy of the database to `path` (VACUUM INTO a private .tmp, then
  // rename), mode 0600.
  absl::Status BackupTo(const std::string& path);
  int64_t LastInsertRowId() const;
  // Rows changed by the last INSERT/UPDATE/DELETE.
  int Changes() const;

 private:
  SqliteDb() = default;
  // sqlite3_open_v2 with `flags`, the busy timeout and extended result codes.
  static absl::StatusOr<std::unique_ptr<SqliteDb>> OpenWithFlags(const std::string& path,
                                                                 int flags);
  // `begin`; body; COMMIT, or ROLLBACK when either fails.
  absl::Status RunTransaction(const char* begin, absl::FunctionRef<absl::Status()> body);

  std::string path_;     // database file, for error messages
  sqlite3* db_ = nullptr;  // the connection
};

}  // namespace quantd::store

#endif  // QUANTD_SERVER_STORE_SQLITE_DB_H_
