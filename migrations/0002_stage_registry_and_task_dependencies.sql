-- quantd state, version 2: stage kinds are whatever the stage registry names
-- (server/pipeline/stage_registry.cc), so the CHECK on stages.kind goes; tasks get a label for
-- people, the device they require, and dependency edges (a task is leased once the tasks it
-- depends on are DONE); stages may produce amax contributions per task (replaced, never added, when
-- the task runs again).

-- SQLite cannot drop a constraint in place: the table is rebuilt (ApplyMigrations runs with
-- foreign keys off and checks them before committing).
CREATE TABLE stages_v2 (
  id           INTEGER PRIMARY KEY,
  job_id       INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
  ordinal      INTEGER NOT NULL,            -- display order within the job
  kind         TEXT NOT NULL,               -- a kind of the stage registry
  state        TEXT NOT NULL CHECK (state IN ('PENDING', 'RUNNING', 'SUCCEEDED', 'FAILED')),
  started_ms   INTEGER,
  finished_ms  INTEGER,
  UNIQUE (job_id, ordinal)
) STRICT;
INSERT INTO stages_v2 (id, job_id, ordinal, kind, state, started_ms, finished_ms)
  SELECT id, job_id, ordinal, kind, state, started_ms, finished_ms FROM stages;
DROP TABLE stages;
ALTER TABLE stages_v2 RENAME TO stages;

ALTER TABLE tasks ADD COLUMN label TEXT NOT NULL DEFAULT '';         -- e.g. 'shard 3 of 12'
ALTER TABLE tasks ADD COLUMN requires_gpu INTEGER NOT NULL DEFAULT 0;  -- 1: only on a CUDA device
ALTER TABLE tasks ADD COLUMN memory_bytes INTEGER NOT NULL DEFAULT 0;  -- device memory it holds

-- task_id is leased only once every depends_on task is DONE.
CREATE TABLE task_deps (
  task_id     INTEGER NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
  depends_on  INTEGER NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
  PRIMARY KEY (task_id, depends_on)
) STRICT, WITHOUT ROWID;
CREATE INDEX task_deps_by_dependency ON task_deps(depends_on);

-- Plans stored by version 1 ran stage after stage: each of their tasks waits for every task of
-- the stage before it, which keeps their order exactly as it was.
INSERT INTO task_deps (task_id, depends_on)
  SELECT t.id, p.id
  FROM tasks t
  JOIN stages s ON s.id = t.stage_id
  JOIN stages ps ON ps.job_id = s.job_id AND ps.ordinal = s.ordinal - 1
  JOIN tasks p ON p.stage_id = ps.id;

-- Version 1's multi-task stages (dequant, quantize, verify) had one task per shard.
UPDATE tasks SET label = 'shard ' || (ordinal + 1) || ' of ' ||
    (SELECT COUNT(*) FROM tasks o WHERE o.stage_id = tasks.stage_id)
  WHERE (SELECT COUNT(*) FROM tasks o WHERE o.stage_id = tasks.stage_id) > 1;

-- What one task contributed to the job's amax table (JobStore::ListAmax merges these with the
-- job-level rows of `amax`); a task that runs again replaces its rows.
CREATE TABLE task_amax (
  task_id  INTEGER NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
  job_id   INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
  module   TEXT NOT NULL,
  kind     TEXT NOT NULL CHECK (kind IN ('input', 'kv')),
  value    REAL NOT NULL CHECK (value >= 0),
  samples  INTEGER NOT NULL,
  PRIMARY KEY (task_id, module, kind)
) STRICT;
CREATE INDEX task_amax_by_job ON task_amax(job_id);
