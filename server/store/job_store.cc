#include "server/store/job_store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/base/status_macros.h"
#include "server/store/migrations.h"

namespace quantd::store {
namespace {

// A figure column: NULL (how SQLite stores a NaN) reads as NaN.
double ColumnFigure(const Statement& st, int col) {
  return st.ColumnIsNull(col) ? std::numeric_limits<double>::quiet_NaN() : st.ColumnDouble(col);
}

constexpr const char* kJobStateNames[] = {"PENDING",   "RUNNING", "PAUSED",
                                          "SUCCEEDED", "FAILED",  "CANCELLED"};
constexpr const char* kStageStateNames[] = {"PENDING", "RUNNING", "SUCCEEDED", "FAILED"};
constexpr const char* kTaskStateNames[] = {"PENDING", "LEASED", "DONE", "FAILED"};

template <typename Enum, size_t N>
std::optional<Enum> ParseName(const std::string& name, const char* const (&names)[N]) {
  for (size_t i = 0; i < N; ++i) {
    if (name == names[i]) return static_cast<Enum>(i);
  }
  return std::nullopt;
}

// The job model's transitions (DESIGN.md "Job model"). FAILED and PAUSED jobs can be resumed;
// SUCCEEDED and CANCELLED are final.
bool TransitionAllowed(JobState from, JobState to) {
  switch (from) {
    case JobState::kPending:
      return to == JobState::kRunning || to == JobState::kCancelled || to == JobState::kFailed;
    case JobState::kRunning:
      return to == JobState::kSucceeded || to == JobState::kFailed || to == JobState::kPaused ||
             to == JobState::kCancelled || to == JobState::kPending;
    case JobState::kPaused:
    case JobState::kFailed:
      return to == JobState::kPending || to == JobState::kRunning || to == JobState::kCancelled;
    case JobState::kSucceeded:
    case JobState::kCancelled:
      return false;
  }
  return false;
}

constexpr char kJobColumns[] =
    "id, IFNULL(request_id, ''), spec_json, state, reason, error, created_ms, updated_ms, "
    "started_ms, finished_ms";

JobRow ReadJob(const Statement& st) {
  JobRow row;
  row.id = st.ColumnInt(0);
  row.request_id = st.ColumnText(1);
  row.spec_json = st.ColumnText(2);
  row.state = ParseJobState(st.ColumnText(3)).value_or(JobState::kFailed);
  row.reason = st.ColumnText(4);
  row.error = CapStoredMessage(st.ColumnText(5));
  row.created_ms = st.ColumnInt(6);
  row.updated_ms = st.ColumnInt(7);
  row.started_ms = st.ColumnOptionalInt(8);
  row.finished_ms = st.ColumnOptionalInt(9);
  return row;
}

constexpr char kTaskColumns[] =
    "t.id, t.job_id, t.stage_id, s.kind, t.ordinal, t.name, t.payload_json, t.bytes_total, "
    "t.state, t.attempt, IFNULL(t.lease_owner, ''), t.lease_expires_ms, IFNULL(t.output_path, ''), "
    "t.output_bytes, IFNULL(t.output_sha256, ''), t.error, t.label, t.requires_gpu, "
    "t.memory_bytes, IFNULL(t.ran_by, '')";

TaskRow ReadTask(const Statement& st) {
  TaskRow row;
  row.id = st.ColumnInt(0);
  row.job_id = st.ColumnInt(1);
  row.stage_id = st.ColumnInt(2);
  row.stage_kind = st.ColumnText(3);
  row.ordinal = st.ColumnInt(4);
  row.name = st.ColumnText(5);
  row.payload_json = st.ColumnText(6);
  row.bytes_total = st.ColumnInt(7);
  row.state = ParseName<TaskState>(st.ColumnText(8), kTaskStateNames).value_or(TaskState::kFailed);
  row.attempt = static_cast<int>(st.ColumnInt(9));
  row.lease_owner = st.ColumnText(10);
  row.lease_expires_ms = st.ColumnOptionalInt(11);
  row.output_path = st.ColumnText(12);
  row.output_bytes = st.ColumnOptionalInt(13);
  row.output_sha256 = st.ColumnText(14);
  row.error = CapStoredMessage(st.ColumnText(15));
  row.label = st.ColumnText(16);
  row.requirement.gpu = st.ColumnInt(17) != 0;
  row.requirement.memory_bytes = st.ColumnInt(18);
  row.ran_by = st.ColumnText(19);
  return row;
}

// Runs `sql` with the given int64 parameters and returns the first column of the first row.
absl::StatusOr<std::optional<int64_t>> QueryInt(SqliteDb& db, const std::string& sql,
                                                std::initializer_list<int64_t> params) {
  absl::StatusOr<Statement> st = db.Prepare(sql);
  if (!st.ok()) return st.status();
  int i = 1;
  for (int64_t p : params) st->Bind(i++, p);
  absl::StatusOr<bool> row = st->Step();
  if (!row.ok()) return row.status();
  if (!*row || st->ColumnIsNull(0)) return std::optional<int64_t>();
  return std::optional<int64_t>(st->ColumnInt(0));
}

absl::Status NotFoundJob(int64_t job_id) {
  return absl::NotFoundError(absl::StrCat("job ", job_id, " does not exist"));
}

}  // namespace

absl::Status TaskRecord::PutTensorStats(const std::vector<TensorStatsRow>& rows) {
  absl::StatusOr<Statement> up = db_.Prepare(
      "INSERT OR REPLACE INTO tensor_stats (job_id, tensor, rel_rmse, sqnr_db, max_abs_err) "
      "VALUES (?, ?, ?, ?, ?)");
  if (!up.ok()) return up.status();
  for (const TensorStatsRow& r : rows) {
    up->Reset();
    up->Bind(1, job_id_).Bind(2, r.tensor).Bind(3, r.rel_rmse).Bind(4, r.sqnr_db);
    up->Bind(5, r.max_abs_err);
    if (absl::Status s = up->Run(); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("statistics of ", r.tensor, ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status TaskRecord::PutTaskAmax(const std::vector<AmaxRow>& rows) {
  absl::StatusOr<Statement> del = db_.Prepare("DELETE FROM task_amax WHERE task_id = ?");
  if (!del.ok()) return del.status();
  del->Bind(1, task_id_);
  if (absl::Status s = del->Run(); !s.ok()) return s;
  absl::StatusOr<Statement> ins = db_.Prepare(
      "INSERT INTO task_amax (task_id, job_id, module, kind, value, samples) "
      "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (task_id, module, kind) DO UPDATE SET "
      "value = MAX(value, excluded.value), samples = samples + excluded.samples");
  if (!ins.ok()) return ins.status();
  for (const AmaxRow& r : rows) {
    ins->Reset();
    ins->Bind(1, task_id_).Bind(2, job_id_).Bind(3, r.module).Bind(4, r.kind).Bind(5, r.value);
    ins->Bind(6, r.samples);
    if (absl::Status s = ins->Run(); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("amax of ", r.module, ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status TaskRecord::PutEvaluationLayer(const EvaluationLayerRow& r) {
  // Binding a NaN stores NULL.
  absl::StatusOr<Statement> up = db_.Prepare(
      "INSERT OR REPLACE INTO evaluation_layers (task_id, job_id, layer, free_running_signal, "
      "free_running_noise, teacher_forced_signal, teacher_forced_noise, seconds) "
      "VALUES (?, ?, ?, ?, ?, ?, ?, ?)");
  if (!up.ok()) return up.status();
  up->Bind(1, task_id_).Bind(2, job_id_).Bind(3, r.layer).Bind(4, r.free_running_signal);
  up->Bind(5, r.free_running_noise).Bind(6, r.teacher_forced_signal);
  up->Bind(7, r.teacher_forced_noise).Bind(8, r.seconds);
  if (absl::Status s = up->Run(); !s.ok()) {
    return absl::Status(s.code(),
                        absl::StrCat("evaluation of layer ", r.layer, ": ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status TaskRecord::PutEvaluation(const EvaluationRow& r) {
  absl::StatusOr<Statement> up = db_.Prepare(
      "INSERT OR REPLACE INTO evaluations (job_id, task_id, samples, tokens, numerics, positions, "
      "predicted, mean_kl, p99_kl, max_kl, top1_agreement, source_ppl, quantized_ppl, ppl_ratio, "
      "gate_passed, gate_message, seconds) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
      "?, ?)");
  if (!up.ok()) return up.status();
  up->Bind(1, job_id_).Bind(2, task_id_).Bind(3, r.samples).Bind(4, r.tokens).Bind(5, r.numerics);
  up->Bind(6, r.positions).Bind(7, r.predicted).Bind(8, r.mean_kl).Bind(9, r.p99_kl);
  up->Bind(10, r.max_kl).Bind(11, r.top1_agreement).Bind(12, r.source_ppl);
  up->Bind(13, r.quantized_ppl).Bind(14, r.ppl_ratio).Bind(15, int64_t{r.gate_passed ? 1 : 0});
  up->Bind(16, CapStoredMessage(r.gate_message)).Bind(17, r.seconds);
  if (absl::Status s = up->Run(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("evaluation figures: ", s.message()));
  }
  return absl::OkStatus();
}

const char* JobStateName(JobState s) { return kJobStateNames[static_cast<int>(s)]; }
std::optional<JobState> ParseJobState(const std::string& name) {
  return ParseName<JobState>(name, kJobStateNames);
}
const char* StageStateName(StageState s) { return kStageStateNames[static_cast<int>(s)]; }
const char* TaskStateName(TaskState s) { return kTaskStateNames[static_cast<int>(s)]; }
bool IsTerminal(JobState s) {
  return s == JobState::kSucceeded || s == JobState::kFailed || s == JobState::kCancelled;
}

std::string CapStoredMessage(std::string message) {
  if (message.size() <= kMaxStoredMessageBytes) return message;
  const std::string note = absl::StrCat("... (", message.size(), " bytes in all)");
  size_t keep = kMaxStoredMessageBytes - note.size();
  // Not inside a UTF-8 character: back over its continuation bytes (10xxxxxx).
  while (keep > 0 && (static_cast<unsigned char>(message[keep]) & 0xC0) == 0x80) --keep;
  message.resize(keep);
  message += note;
  return message;
}

absl::StatusOr<std::unique_ptr<JobStore>> JobStore::Open(const std::string& path,
                                                        const StoreOpenOptions& options) {
  // What to do about a damaged or missing database, for the errors below.
  const std::string remedy =
      options.backup_path.empty()
          ? std::string("move it away and start with --init to begin an empty history")
          : absl::StrCat(
                access(options.backup_path.c_str(), F_OK) == 0
                    ? absl::StrCat("restore the backup ", options.backup_path,
                                   " (written at the last start that passed this check)")
                    : absl::StrCat("no backup exists at ", options.backup_path),
                ", or move it away and start with --init to begin an empty history");
  if (options.must_exist) {
    struct stat st;
    const bool missing = stat(path.c_str(), &st) != 0;
    if (missing || st.st_size == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("state database ", path, missing ? " is missing" : " is empty (0 bytes)",
                       " but its state dir holds other files: ", remedy));
    }
  }
  absl::StatusOr<std::unique_ptr<SqliteDb>> db = SqliteDb::Open(path);
  absl::Status checked = db.ok() && options.check_integrity ? (*db)->QuickCheck() : db.status();
  if (!checked.ok()) {
    if (!options.check_integrity) return checked;
    return absl::Status(checked.code(), absl::StrCat(checked.message(), "; quantd will not run on "
                                                     "a damaged database: ", remedy));
  }
  if (absl::StatusOr<int> v = ApplyMigrations(**db, BuiltinMigrations()); !v.ok()) {
    return v.status();
  }
  if (!options.backup_path.empty()) {
    if (absl::Status s = (*db)->BackupTo(options.backup_path); !s.ok()) return s;
  }
  return std::unique_ptr<JobStore>(new JobStore(std::move(*db)));
}

absl::StatusOr<std::unique_ptr<JobStore>> JobStore::OpenReadOnly(const std::string& path) {
  ASSIGN_OR_RETURN(std::unique_ptr<SqliteDb> db, SqliteDb::OpenReadOnly(path));
  return std::unique_ptr<JobStore>(new JobStore(std::move(db)));
}

absl::StatusOr<int64_t> JobStore::CreateJob(const std::string& request_id,
                                            const std::string& spec_json, int64_t now_ms,
                                            bool* created) {
  int64_t id = 0;
  bool inserted = false;
  absl::Status s = db_->Transaction([&]() -> absl::Status {
    if (!request_id.empty()) {
      absl::StatusOr<Statement> find = db_->Prepare("SELECT id FROM jobs WHERE request_id = ?");
      if (!find.ok()) return find.status();
      find->Bind(1, request_id);
      absl::StatusOr<bool> row = find->Step();
      if (!row.ok()) return row.status();
      if (*row) {
        id = find->ColumnInt(0);
        return absl::OkStatus();
      }
    }
    absl::StatusOr<Statement> ins = db_->Prepare(
        "INSERT INTO jobs (request_id, spec_json, state, created_ms, updated_ms) "
        "VALUES (?, ?, 'PENDING', ?, ?)");
    if (!ins.ok()) return ins.status();
    if (request_id.empty()) {
      ins->BindNull(1);
    } else {
      ins->Bind(1, request_id);
    }
    ins->Bind(2, spec_json).Bind(3, now_ms).Bind(4, now_ms);
    if (absl::Status r = ins->Run(); !r.ok()) return r;
    id = db_->LastInsertRowId();
    inserted = true;
    absl::StatusOr<Statement> ev = db_->Prepare(
        "INSERT INTO events (job_id, at_ms, kind, message) VALUES (?, ?, 'state', 'PENDING')");
    if (!ev.ok()) return ev.status();
    ev->Bind(1, id).Bind(2, now_ms);
    return ev->Run();
  });
  if (!s.ok()) return s;
  if (created != nullptr) *created = inserted;
  return id;
}

absl::StatusOr<JobRow> JobStore::GetJob(int64_t job_id) {
  absl::StatusOr<Statement> st =
      db_->Prepare(absl::StrCat("SELECT ", kJobColumns, " FROM jobs WHERE id = ?"));
  if (!st.ok()) return st.status();
  st->Bind(1, job_id);
  absl::StatusOr<bool> row = st->Step();
  if (!row.ok()) return row.status();
  if (!*row) return NotFoundJob(job_id);
  return ReadJob(*st);
}

absl::StatusOr<std::optional<JobRow>> JobStore::FindJobByRequestId(
    const std::string& request_id) {
  absl::StatusOr<Statement> st =
      db_->Prepare(absl::StrCat("SELECT ", kJobColumns, " FROM jobs WHERE request_id = ?"));
  if (!st.ok()) return st.status();
  st->Bind(1, request_id);
  absl::StatusOr<bool> row = st->Step();
  if (!row.ok()) return row.status();
  if (!*row) return std::optional<JobRow>();
  return std::optional<JobRow>(ReadJob(*st));
}

absl::StatusOr<std::vector<JobRow>> JobStore::ListJobs(std::optional<JobState> state,
                                                       int64_t after_id, int limit) {
  std::string sql = absl::StrCat("SELECT ", kJobColumns, " FROM jobs WHERE id > ?");
  if (state.has_value()) absl::StrAppend(&sql, " AND state = ?");
  absl::StrAppend(&sql, " ORDER BY id LIMIT ?");
  absl::StatusOr<Statement> st = db_->Prepare(sql);
  if (!st.ok()) return st.status();
  int i = 1;
  st->Bind(i++, after_id);
  if (state.has_value()) st->Bind(i++, JobStateName(*state));
  st->Bind(i++, static_cast<int64_t>(limit));
  std::vector<JobRow> out;
  while (true) {
    absl::StatusOr<bool> row = st->Step();
    if (!row.ok()) return row.status();
    if (!*row) break;
    out.push_back(ReadJob(*st));
  }
  return out;
}

absl::Status JobStore::DeleteJob(int64_t job_id, DeletePrecondition precondition) {
  return db_->Transaction([&]() -> absl::Status {
    absl::StatusOr<JobRow> job = GetJob(job_id);
    if (!job.ok()) return job.status();
    if (job->state == JobState::kRunning) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", job_id, " is RUNNING; cancel it before deleting"));
    }
    if (precondition == DeletePrecondition::kFinished && !IsTerminal(job->state)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", job_id, " is ", JobStateName(job->state), ", no longer finished; kept"));
    }
    absl::StatusOr<Statement> del = db_->Prepare("DELETE FROM jobs WHERE id = ?");
    if (!del.ok()) return del.status();
    del->Bind(1, job_id);
    return del->Run();
  });
}

absl::Status JobStore::SetJobState(int64_t job_id, JobState state, const std::string& reason,
                                   const std::string& error, int64_t now_ms) {
  return db_->Transaction([&]() -> absl::Status {
    absl::StatusOr<JobRow> job = GetJob(job_id);
    if (!job.ok()) return job.status();
    if (job->state != state && !TransitionAllowed(job->state, state)) {
      return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " cannot go from ",
                                                        JobStateName(job->state), " to ",
                                                        JobStateName(state)));
    }
    absl::StatusOr<Statement> up = db_->Prepare(
        "UPDATE jobs SET state = ?, reason = ?, error = ?, updated_ms = ?, "
        "started_ms = CASE WHEN ? AND started_ms IS NULL THEN ? ELSE started_ms END, "
        "finished_ms = CASE WHEN ? THEN ? ELSE NULL END WHERE id = ?");
    if (!up.ok()) return up.status();
    up->Bind(1, JobStateName(state)).Bind(2, reason).Bind(3, CapStoredMessage(error));
    up->Bind(4, now_ms);
    up->Bind(5, int64_t{state == JobState::kRunning}).Bind(6, now_ms);
    up->Bind(7, int64_t{IsTerminal(state)}).Bind(8, now_ms).Bind(9, job_id);
    if (absl::Status s = up->Run(); !s.ok()) return s;
    std::string message = JobStateName(state);
    if (!reason.empty()) absl::StrAppend(&message, " (", reason, ")");
    if (!error.empty()) absl::StrAppend(&message, ": ", error);
    return AddEvent(job_id, "state", message, now_ms);
  });
}

absl::Status JobStore::SetPlan(int64_t job_id, const std::vector<StagePlan>& stages) {
  if (stages.empty()) return absl::InvalidArgumentError("a plan needs at least one stage");
  // (kind, task name) -> (stage index, task index) of the tasks seen so far: a dependency must be
  // among them (an earlier stage's task, or an earlier task of its own stage), so edges never form
  // a cycle.
  std::map<std::pair<std::string, std::string>, std::pair<size_t, size_t>> task_index;
  std::set<std::string> kinds;
  for (size_t si = 0; si < stages.size(); ++si) {
    const StagePlan& stage = stages[si];
    if (stage.tasks.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("stage ", stage.kind, " has no tasks"));
    }
    if (!kinds.insert(stage.kind).second) {
      return absl::InvalidArgumentError(absl::StrCat("stage ", stage.kind, " appears twice"));
    }
    for (size_t ti = 0; ti < stage.tasks.size(); ++ti) {
      const TaskPlan& t = stage.tasks[ti];
      for (const TaskRef& dep : t.depends_on) {
        if (task_index.count({dep.stage, dep.task}) == 0) {
          return absl::InvalidArgumentError(
              absl::StrCat(stage.kind, " task ", t.name, " depends on ", dep.stage, " task ",
                           dep.task, ", which is not planned before it"));
        }
      }
      if (!task_index.emplace(std::make_pair(stage.kind, t.name), std::make_pair(si, ti)).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("stage ", stage.kind, " has two tasks named ", t.name));
      }
    }
  }
  return db_->Transaction([&]() -> absl::Status {
    absl::StatusOr<std::optional<int64_t>> exists =
        QueryInt(*db_, "SELECT id FROM jobs WHERE id = ?", {job_id});
    if (!exists.ok()) return exists.status();
    if (!exists->has_value()) return NotFoundJob(job_id);
    absl::StatusOr<std::optional<int64_t>> n =
        QueryInt(*db_, "SELECT COUNT(*) FROM stages WHERE job_id = ?", {job_id});
    if (!n.ok()) return n.status();
    if (n->value_or(0) > 0) {
      return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " already has a plan"));
    }
    absl::StatusOr<Statement> ins_stage = db_->Prepare(
        "INSERT INTO stages (job_id, ordinal, kind, state) VALUES (?, ?, ?, 'PENDING')");
    if (!ins_stage.ok()) return ins_stage.status();
    absl::StatusOr<Statement> ins_task = db_->Prepare(
        "INSERT INTO tasks (job_id, stage_id, ordinal, name, payload_json, bytes_total, state, "
        "label, requires_gpu, memory_bytes) VALUES (?, ?, ?, ?, ?, ?, 'PENDING', ?, ?, ?)");
    if (!ins_task.ok()) return ins_task.status();
    absl::StatusOr<Statement> ins_dep =
        db_->Prepare("INSERT OR IGNORE INTO task_deps (task_id, depends_on) VALUES (?, ?)");
    if (!ins_dep.ok()) return ins_dep.status();
    std::vector<std::vector<int64_t>> task_ids(stages.size());
    for (size_t si = 0; si < stages.size(); ++si) {
      ins_stage->Reset();
      ins_stage->Bind(1, job_id).Bind(2, static_cast<int64_t>(si)).Bind(3, stages[si].kind);
      if (absl::Status s = ins_stage->Run(); !s.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("stage ", si, " (", stages[si].kind, "): ", s.message()));
      }
      const int64_t stage_id = db_->LastInsertRowId();
      for (size_t ti = 0; ti < stages[si].tasks.size(); ++ti) {
        const TaskPlan& t = stages[si].tasks[ti];
        ins_task->Reset();
        ins_task->Bind(1, job_id).Bind(2, stage_id).Bind(3, static_cast<int64_t>(ti));
        ins_task->Bind(4, t.name).Bind(5, t.payload_json).Bind(6, t.bytes_total);
        ins_task->Bind(7, t.label).Bind(8, int64_t{t.requirement.gpu});
        ins_task->Bind(9, t.requirement.memory_bytes);
        if (absl::Status s = ins_task->Run(); !s.ok()) return s;
        task_ids[si].push_back(db_->LastInsertRowId());
      }
    }
    for (size_t si = 0; si < stages.size(); ++si) {
      for (size_t ti = 0; ti < stages[si].tasks.size(); ++ti) {
        for (const TaskRef& dep : stages[si].tasks[ti].depends_on) {
          const auto [dsi, dti] = task_index.at({dep.stage, dep.task});
          ins_dep->Reset();
          ins_dep->Bind(1, task_ids[si][ti]).Bind(2, task_ids[dsi][dti]);
          if (absl::Status s = ins_dep->Run(); !s.ok()) return s;
        }
      }
    }
    return absl::OkStatus();
  });
}

bool JobStore::HasPlan(int64_t job_id) {
  absl::StatusOr<std::optional<int64_t>> n =
      QueryInt(*db_, "SELECT COUNT(*) FROM stages WHERE job_id = ?", {job_id});
  return n.ok() && n->value_or(0) > 0;
}

absl::StatusOr<std::vector<std::pair<int64_t, int64_t>>> JobStore::ListDependencies(
    int64_t job_id) {
  absl::StatusOr<Statement> st = db_->Prepare(
      "SELECT d.task_id, d.depends_on FROM task_deps d JOIN tasks t ON t.id = d.task_id "
      "WHERE t.job_id = ? ORDER BY d.task_id, d.depends_on");
  if (!st.ok()) return st.status();
  st->Bind(1, job_id);
  std::vector<std::pair<int64_t, int64_t>> out;
  while (true) {
    absl::StatusOr<bool> row = st->Step();
    if (!row.ok()) return row.status();
    if (!*row) break;
    out.emplace_back(st->ColumnInt(0), st->ColumnInt(1));
  }
  return out;
}

absl::StatusOr<std::optional<TaskRow>> JobStore::LeaseNextTask(int64_t job_id,
                                                               const std::string& owner,
                                                               int64_t now_ms, int64_t lease_ms,
                                                               TaskLease* lease,
                                                               const DeviceCapacity& capacity) {
  std::optional<TaskRow> result;
  absl::Status s = db_->Transaction([&]() -> absl::Status {
    absl::StatusOr<Statement> pick = db_->Prepare(absl::StrCat(
        "SELECT ", kTaskColumns,
        " FROM tasks t JOIN stages s ON s.id = t.stage_id WHERE t.job_id = ? AND "
        "t.state = 'PENDING' AND t.not_before_ms <= ? AND (t.requires_gpu = 0 OR ?) AND "
        "t.memory_bytes <= ? AND NOT EXISTS (SELECT 1 FROM task_deps d JOIN tasks p ON "
        "p.id = d.depends_on WHERE d.task_id = t.id AND p.state != 'DONE') "
        "ORDER BY s.ordinal, t.ordinal LIMIT 1"));
    if (!pick.ok()) return pick.status();
    pick->Bind(1, job_id).Bind(2, now_ms).Bind(3, int64_t{capacity.gpu});
    pick->Bind(4, capacity.memory_bytes);
    absl::StatusOr<bool> row = pick->Step();
    if (!row.ok()) return row.status();
    if (!*row) return absl::OkStatus();
    TaskRow task = ReadTask(*pick);
    task.state = TaskState::kLeased;
    task.attempt += 1;
    task.lease_owner = owner;
    task.lease_expires_ms = now_ms + lease_ms;
    task.error.clear();
    absl::StatusOr<Statement> up = db_->Prepare(
        "UPDATE tasks SET state = 'LEASED', attempt = ?, lease_owner = ?, lease_expires_ms = ?, "
        "started_ms = ?, error = '' WHERE id = ?");
    if (!up.ok()) return up.status();
    up->Bind(1, static_cast<int64_t>(task.attempt)).Bind(2, owner).Bind(3, now_ms + lease_ms);
    up->Bind(4, now_ms).Bind(5, task.id);
    if (absl::Status r = up->Run(); !r.ok()) return r;
    absl::StatusOr<Statement> st = db_->Prepare(
        "UPDATE stages SET state = 'RUNNING', started_ms = IFNULL(started_ms, ?) "
        "WHERE id = ? AND state = 'PENDING'");
    if (!st.ok()) return st.status();
    st->Bind(1, now_ms).Bind(2, task.stage_id);
    if (absl::Status r = st->Run(); !r.ok()) return r;
    result = std::move(task);
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  if (result.has_value() && lease != nullptr) {
    *lease = TaskLease{result->id, result->attempt, owner, *result->lease_expires_ms};
  }
  return result;
}

absl::Status JobStore::RenewLease(TaskLease& lease, int64_t now_ms, int64_t lease_ms) {
  absl::StatusOr<Statement> up = db_->Prepare(
      "UPDATE tasks SET lease_expires_ms = ? WHERE id = ? AND state = 'LEASED' AND attempt = ? "
      "AND lease_owner = ?");
  if (!up.ok()) return up.status();
  up->Bind(1, now_ms + lease_ms).Bind(2, lease.task_id).Bind(3, int64_t{lease.attempt});
  up->Bind(4, lease.owner);
  if (absl::Status s = up->Run(); !s.ok()) return s;
  if (db_->Changes() == 0) {
    return absl::FailedPreconditionError(absl::StrCat("task ", lease.task_id, " attempt ",
                                                      lease.attempt, ": lease lost"));
  }
  lease.expires_ms = now_ms + lease_ms;
  return absl::OkStatus();
}

absl::Status JobStore::CompleteTask(const TaskLease& lease, const std::string& output_path,
                                    int64_t output_bytes, const std::string& output_sha256,
                                    int64_t now_ms,
                                    const std::function<absl::Status(TaskRecord&)>& record) {
  return db_->Transaction([&]() -> absl::Status {
    absl::StatusOr<Statement> up = db_->Prepare(
        "UPDATE tasks SET state = 'DONE', output_path = ?, output_bytes = ?, output_sha256 = ?, "
        "finished_ms = ?, ran_by = lease_owner, lease_owner = NULL, lease_expires_ms = NULL "
        "WHERE id = ? AND state = 'LEASED' AND attempt = ? AND lease_owner = ?");
    if (!up.ok()) return up.status();
    up->Bind(1, output_path).Bind(2, output_bytes).Bind(3, output_sha256).Bind(4, now_ms);
    up->Bind(5, lease.task_id).Bind(6, int64_t{lease.attempt}).Bind(7, lease.owner);
    if (absl::Status s = up->Run(); !s.ok()) return s;
    if (db_->Changes() == 0) {
      // Idempotent: the same attempt completing twice is fine; anything else lost its lease.
      absl::StatusOr<std::optional<int64_t>> done = QueryInt(
          *db_, "SELECT COUNT(*) FROM tasks WHERE id = ? AND state = 'DONE' AND attempt = ?",
          {lease.task_id, int64_t{lease.attempt}});
      if (!done.ok()) return done.status();
      if (done->value_or(0) == 1) return absl::OkStatus();
      return absl::FailedPreconditionError(absl::StrCat("task ", lease.task_id, " attempt ",
                                                        lease.attempt, ": lease lost"));
    }
    if (record) {
      absl::StatusOr<std::optional<int64_t>> job_id =
          QueryInt(*db_, "SELECT job_id FROM tasks WHERE id = ?", {lease.task_id});
      if (!job_id.ok()) return job_id.status();
      TaskRecord txn(*db_, job_id->value_or(0), lease.task_id);
      if (absl::Status s = record(txn); !s.ok()) return s;
    }
    absl::StatusOr<Statement> stage = db_->Prepare(
        "UPDATE stages SET state = 'SUCCEEDED', finished_ms = ? WHERE id = "
        "(SELECT stage_id FROM tasks WHERE id = ?) AND NOT EXISTS (SELECT 1 FROM tasks WHERE "
        "stage_id = stages.id AND state != 'DONE')");
    if (!stage.ok()) return stage.status();
    stage->Bind(1, now_ms).Bind(2, lease.task_id);
    return stage->Run();
  });
}

absl::Status JobStore::FailTask(const TaskLease& lease, const std::string& error, bool permanent,
                                int64_t retry_at_ms, int64_t now_ms) {
  return db_->Transaction([&]() -> absl::Status {
    absl::StatusOr<Statement> up = db_->Prepare(
        "UPDATE tasks SET state = ?1, error = ?2, not_before_ms = ?3, finished_ms = ?4, "
        "ran_by = CASE WHEN ?1 = 'FAILED' THEN lease_owner ELSE ran_by END, "
        "lease_owner = NULL, lease_expires_ms = NULL "
        "WHERE id = ?5 AND state = 'LEASED' AND attempt = ?6 AND lease_owner = ?7");
    if (!up.ok()) return up.status();
    up->Bind(1, permanent ? "FAILED" : "PENDING").Bind(2, CapStoredMessage(error));
    up->Bind(3, retry_at_ms);
    up->Bind(4, now_ms).Bind(5, lease.task_id).Bind(6, int64_t{lease.attempt}).Bind(7, lease.owner);
    if (absl::Status s = up->Run(); !s.ok()) return s;
    if (db_->Changes() == 0) {
      return absl::FailedPreconditionError(absl::StrCat("task ", lease.task_id, " attempt ",
                                                        lease.attempt, ": lease lost"));
    }
    if (!permanent) return absl::OkStatus();
    absl::StatusOr<Statement> stage = db_->Prepare(
        "UPDATE stages SET state = 'FAILED', finished_ms = ? WHERE id = "
        "(SELECT stage_id FROM tasks WHERE id = ?)");
    if (!stage.ok()) return stage.status();
    stage->Bind(1, now_ms).Bind(2, lease.task_id);
    return stage->Run();
  });
}

absl::StatusOr<int> JobStore::RequeueDoneTasks(int64_t job_id,
                                                const std::vector<int64_t>& task_ids,
                                                const std::string& reason, int64_t now_ms) {
  if (task_ids.empty()) return 0;
  int changed = 0;
  absl::Status s = db_->Transaction([&]() -> absl::Status {
    // The tasks and, transitively, the DONE tasks that depend on them.
    const std::string stale = absl::StrCat(
        "WITH RECURSIVE stale(id) AS (SELECT id FROM tasks WHERE job_id = ? AND id IN (",
        absl::StrJoin(task_ids, ", "),
        ") UNION SELECT d.task_id FROM task_deps d JOIN stale ON d.depends_on = stale.id) ");
    absl::StatusOr<Statement> stages = db_->Prepare(absl::StrCat(
        stale,
        "UPDATE stages SET state = 'RUNNING', finished_ms = NULL WHERE state = 'SUCCEEDED' AND "
        "id IN (SELECT stage_id FROM tasks WHERE state = 'DONE' AND id IN stale)"));
    if (!stages.ok()) return stages.status();
    stages->Bind(1, job_id);
    if (absl::Status r = stages->Run(); !r.ok()) return r;
    absl::StatusOr<Statement> up = db_->Prepare(absl::StrCat(
        stale,
        "UPDATE tasks SET state = 'PENDING', output_path = NULL, output_bytes = NULL, "
        "output_sha256 = NULL, not_before_ms = 0, error = ? WHERE state = 'DONE' AND id IN stale"));
    if (!up.ok()) return up.status();
    up->Bind(1, job_id).Bind(2, CapStoredMessage(reason));
    if (absl::Status r = up->Run(); !r.ok()) return r;
    changed = db_->Changes();
    if (changed == 0) return absl::OkStatus();
    return AddEvent(job_id, "requeue",
                    absl::StrCat(changed, " done task(s) requeued: ", reason), now_ms);
  });
  if (!s.ok()) return s;
  return changed;
}

absl::StatusOr<int> JobStore::RequeueExpiredLeases(int64_t now_ms) {
  absl::StatusOr<Statement> up = db_->Prepare(
      "UPDATE tasks SET state = 'PENDING', lease_owner = NULL, lease_expires_ms = NULL, "
      "error = 'lease expired' WHERE state = 'LEASED' AND lease_expires_ms < ?");
  if (!up.ok()) return up.status();
  up->Bind(1, now_ms);
  if (absl::Status s = up->Run(); !s.ok()) return s;
  return db_->Changes();
}

absl::StatusOr<int> JobStore::RequeueJobLeases(int64_t job_id, int64_t now_ms) {
  int changed = 0;
  absl::Status s = db_->Transaction([&]() -> absl::Status {
    absl::StatusOr<Statement> up = db_->Prepare(
        "UPDATE tasks SET state = 'PENDING', lease_owner = NULL, lease_expires_ms = NULL, "
        "error = 'interrupted' WHERE job_id = ? AND state = 'LEASED'");
    if (!up.ok()) return up.status();
    up->Bind(1, job_id);
    if (absl::Status r = up->Run(); !r.ok()) return r;
    changed = db_->Changes();
    if (changed == 0) return absl::OkStatus();
    return AddEvent(job_id, "requeue", absl::StrCat(changed, " interrupted task(s) requeued"),
                    now_ms);
  });
  if (!s.ok()) return s;
  return changed;
}

absl::StatusOr<int> JobStore::ResetFailedTasks(int64_t job_id, int64_t now_ms) {
  int changed = 0;
  absl::Status s = db_->Transaction([&]() -> absl::Status {
    absl::StatusOr<Statement> up = db_->Prepare(
        "UPDATE tasks SET state = 'PENDING', not_before_ms = 0 WHERE job_id = ? AND "
        "state = 'FAILED'");
    if (!up.ok()) return up.status();
    up->Bind(1, job_id);
    if (absl::Status r = up->Run(); !r.ok()) return r;
    changed = db_->Changes();
    absl::StatusOr<Statement> st = db_->Prepare(
        "UPDATE stages SET state = 'RUNNING', finished_ms = NULL WHERE job_id = ? AND "
        "state = 'FAILED'");
    if (!st.ok()) return st.status();
    st->Bind(1, job_id);
    if (absl::Status r = st->Run(); !r.ok()) return r;
    if (changed == 0) return absl::OkStatus();
    return AddEvent(job_id, "retry", absl::StrCat(changed, " failed task(s) reset"), now_ms);
  });
  if (!s.ok()) return s;
  return changed;
}

absl::StatusOr<std::vector<StageProgress>> JobStore::Progress(int64_t job_id) {
  absl::StatusOr<Statement> st = db_->Prepare(
      "SELECT s.id, s.kind, s.state, COUNT(t.id), SUM(t.state = 'DONE'), SUM(t.bytes_total), "
      "SUM(CASE WHEN t.state = 'DONE' THEN t.bytes_total ELSE 0 END), s.started_ms, "
      "s.finished_ms, SUM(t.attempt) FROM stages s LEFT JOIN tasks t ON t.stage_id = s.id WHERE s.job_id = ? "
      "GROUP BY s.id ORDER BY s.ordinal");
  if (!st.ok()) return st.status();
  st->Bind(1, job_id);
  std::vector<StageProgress> out;
  while (true) {
    absl::StatusOr<bool> row = st->Step();
    if (!row.ok()) return row.status();
    if (!*row) break;
    StageProgress p;
    p.stage_id = st->ColumnInt(0);
    p.kind = st->ColumnText(1);
    p.state = ParseName<StageState>(st->ColumnText(2), kStageStateNames)
                  .value_or(StageState::kFailed);
    p.tasks_total = st->ColumnInt(3);
    p.tasks_done = st->ColumnInt(4);
    p.bytes_total = st->ColumnInt(5);
    p.bytes_done = st->ColumnInt(6);
    p.started_ms = st->ColumnOptionalInt(7);
    p.finished_ms = st->ColumnOptionalInt(8);
    p.task_attempts = st->ColumnInt(9);
    out.push_back(std::move(p));
  }
  return out;
}

absl::StatusOr<std::vector<StageRunner>> JobStore::ListStageRunners(int64_t job_id) {
  absl::StatusOr<Statement> st = db_->Prepare(
      "SELECT t.stage_id, t.ran_by, COUNT(*) FROM tasks t JOIN stages s ON s.id = t.stage_id "
      "WHERE t.job_id = ? AND t.state = 'DONE' AND t.ran_by IS NOT NULL "
      "GROUP BY t.stage_id, t.ran_by ORDER BY s.ordinal, t.ran_by");
  if (!st.ok()) return st.status();
  st->Bind(1, job_id);
  std::vector<StageRunner> out;
  while (true) {
    absl::StatusOr<bool> row = st->Step();
    if (!row.ok()) return row.status();
    if (!*row) break;
    out.push_back(StageRunner{st->ColumnInt(0), st->ColumnText(1), st->ColumnInt(2)});
  }
  return out;
}

absl::StatusOr<std::vector<RecordedOutput>> JobStore::FindRecordedOutputs(
    const std::string& output_path) {
  absl::StatusOr<Statement> st = db_->Prepare(
      "SELECT job_id, output_bytes, output_sha256 FROM tasks WHERE state = 'DONE' AND "
      "output_path = ? AND output_bytes IS NOT NULL AND output_sha256 IS NOT NULL ORDER BY id");
  if (!st.ok()) return st.status();
  st->Bind(1, output_path);
  std::vector<RecordedOutput> out;
  while (true) {
    absl::StatusOr<bool> row = st->Step();
    if (!row.ok()) return row.status();
    if (!*row) break;
    out.push_back(RecordedOutput{st->ColumnInt(0), st->ColumnInt(1), st->ColumnText(2)});
  }
  return out;
}

absl::StatusOr<std::vector<TaskRow>> JobStore::ListTasks(int64_t job_id) {
  absl::StatusOr<Statement> st = db_->Prepare(absl::StrCat(
      "SELECT ", kTaskColumns,
      " FROM tasks t JOIN stages s ON s.id = t.stage_id WHERE t.job_id = ? "
      "ORDER BY s.ordinal, t.ordinal"));
  if (!st.ok()) return st.status();
  st->Bind(1, job_id);
  std::vector<TaskRow> out;
  while (true) {
    absl::StatusOr<bool> row = st->Step();
    if (!row.ok()) return row.status();
    if (!*row) break;
    out.push_back(ReadTask(*st));
  }
  return out;
}

absl::Status JobStore::AddEvent(int64_t job_id, const std::string& kind,
                                const std::string& message, int64_t now_ms) {
  absl::StatusOr<Statement> ins =
      db_->Prepare("INSERT INTO events (job_id, at_ms, kind, message) VALUES (?, ?, ?, ?)");
  if (!ins.ok()) return ins.status();
  ins->Bind(1, job_id).Bind(2, now_ms).Bind(3, kind).Bind(4, CapStoredMessage(message));
  return ins->Run();
}

absl::StatusOr<int64_t> JobStore::CountEvents(int64_t job_id, const std::string& kind) {
  absl::StatusOr<Statement> st =
      db_->Prepare("SELECT COUNT(*) FROM events WHERE job_id = ? AND kind = ?");
  if (!st.ok()) return st.status();
  st->Bind(1, job_id).Bind(2, kind);
  absl::StatusOr<bool> row = st->Step();
  if (!row.ok()) return row.status();
  return *row ? st->ColumnInt(0) : 0;
}

absl::StatusOr<std::vector<EventRow>> JobStore::ListEvents(int64_t job_id, int64_t after_id) {
  absl::StatusOr<Statement> st = db_->Prepare(
      "SELECT id, at_ms, kind, message FROM events WHERE job_id = ? AND id > ? ORDER BY id");
  if (!st.ok()) return st.status();
  st->Bind(1, job_id).Bind(2, after_id);
  std::vector<EventRow> out;
  while (true) {
    absl::StatusOr<bool> row = st->Step();
    if (!row.ok()) return row.status();
    if (!*row) break;
    out.push_back(EventRow{st->ColumnInt(0), st->ColumnInt(1), st->ColumnText(2),
                           CapStoredMessage(st->ColumnText(3))});
  }
  return out;
}

absl::Status JobStore::MergeAmax(int64_t job_id, const std::vector<AmaxRow>& rows) {
  return db_->Transaction([&]() -> absl::Status {
    absl::StatusOr<Statement> up = db_->Prepare(
        "INSERT INTO amax (job_id, module, kind, value, samples) VALUES (?, ?, ?, ?, ?) "
        "ON CONFLICT (job_id, module, kind) DO UPDATE SET value = MAX(value, excluded.value), "
        "samples = samples + excluded.samples");
    if (!up.ok()) return up.status();
    for (const AmaxRow& r : rows) {
      up->Reset();
      up->Bind(1, job_id).Bind(2, r.module).Bind(3, r.kind).Bind(4, r.value).Bind(5, r.samples);
      if (absl::Status s = up->Run(); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("amax of ", r.module, ": ", s.message()));
      }
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<std::vector<AmaxRow>> JobStore::ListAmax(int64_t job_id) {
  absl::StatusOr<Statement> st = db_->Prepare(
      "SELECT module, kind, MAX(value), SUM(samples) FROM (SELECT module, kind, value, samples "
      "FROM amax WHERE job_id = ? UNION ALL SELECT module, kind, value, samples FROM task_amax "
      "WHERE job_id = ?) GROUP BY module, kind ORDER BY module, kind");
  if (!st.ok()) return st.status();
  st->Bind(1, job_id).Bind(2, job_id);
  std::vector<AmaxRow> out;
  while (true) {
    absl::StatusOr<bool> row = st->Step();
    if (!row.ok()) return row.status();
    if (!*row) break;
    out.push_back(
        AmaxRow{st->ColumnText(0), st->ColumnText(1), st->ColumnDouble(2), st->ColumnInt(3)});
  }
  return out;
}

absl::StatusOr<std::vector<TaskAmaxRow>> JobStore::ListTaskAmax(int64_t job_id) {
  absl::StatusOr<Statement> st = db_->Prepare(
      "SELECT task_id, module, kind, value, samples FROM task_amax WHERE job_id = ? "
      "ORDER BY task_id, module, kind");
  if (!st.ok()) return st.status();
  st->Bind(1, job_id);
  std::vector<TaskAmaxRow> out;
  while (true) {
    absl::StatusOr<bool> row = st->Step();
    if (!row.ok()) return row.status();
    if (!*row) break;
    out.push_back(TaskAmaxRow{st->ColumnInt(0), AmaxRow{st->ColumnText(1), st->ColumnText(2),
                                                        st->ColumnDouble(3), st->ColumnInt(4)}});
  }
  return out;
}

absl::StatusOr<std::vector<TensorStatsRow>> JobStore::ListTensorStats(int64_t job_id) {
  absl::StatusOr<Statement> st = db_->Prepare(
      "SELECT tensor, rel_rmse, sqnr_db, max_abs_err FROM tensor_stats WHERE job_id = ? "
      "ORDER BY tensor");
  if (!st.ok()) return st.status();
  st->Bind(1, job_id);
  std::vector<TensorStatsRow> out;
  while (true) {
    absl::StatusOr<bool> row = st->Step();
    if (!row.ok()) return row.status();
    if (!*row) break;
    out.push_back(TensorStatsRow{st->ColumnText(0), st->ColumnDouble(1), st->ColumnDouble(2),
                                 st->ColumnDouble(3)});
  }
  return out;
}

absl::StatusOr<std::vector<EvaluationLayerRow>> JobStore::ListEvaluationLayers(int64_t job_id) {
  absl::StatusOr<Statement> st = db_->Prepare(
      "SELECT layer, free_running_signal, free_running_noise, teacher_forced_signal, "
      "teacher_forced_noise, seconds FROM evaluation_layers WHERE job_id = ? ORDER BY layer");
  if (!st.ok()) return st.status();
  st->Bind(1, job_id);
  std::vector<EvaluationLayerRow> out;
  while (true) {
    absl::StatusOr<bool> row = st->Step();
    if (!row.ok()) return row.status();
    if (!*row) break;
    out.push_back(EvaluationLayerRow{st->ColumnInt(0), ColumnFigure(*st, 1), ColumnFigure(*st, 2),
                                     ColumnFigure(*st, 3), ColumnFigure(*st, 4),
                                     st->ColumnDouble(5)});
  }
  return out;
}

absl::StatusOr<std::optional<EvaluationRow>> JobStore::GetEvaluation(int64_t job_id) {
  absl::StatusOr<Statement> st = db_->Prepare(
      "SELECT samples, tokens, numerics, positions, predicted, mean_kl, p99_kl, max_kl, "
      "top1_agreement, source_ppl, quantized_ppl, ppl_ratio, gate_passed, gate_message, seconds "
      "FROM evaluations WHERE job_id = ?");
  if (!st.ok()) return st.status();
  st->Bind(1, job_id);
  absl::StatusOr<bool> row = st->Step();
  if (!row.ok()) return row.status();
  if (!*row) return std::optional<EvaluationRow>();
  EvaluationRow r;
  r.samples = st->ColumnInt(0);
  r.tokens = st->ColumnInt(1);
  r.numerics = st->ColumnText(2);
  r.positions = st->ColumnInt(3);
  r.predicted = st->ColumnInt(4);
  r.mean_kl = ColumnFigure(*st, 5);
  r.p99_kl = ColumnFigure(*st, 6);
  r.max_kl = ColumnFigure(*st, 7);
  r.top1_agreement = ColumnFigure(*st, 8);
  r.source_ppl = ColumnFigure(*st, 9);
  r.quantized_ppl = ColumnFigure(*st, 10);
  r.ppl_ratio = ColumnFigure(*st, 11);
  r.gate_passed = st->ColumnInt(12) != 0;
  r.gate_message = CapStoredMessage(st->ColumnText(13));
  r.seconds = st->ColumnDouble(14);
  return std::optional<EvaluationRow>(std::move(r));
}

}  // namespace quantd::store
