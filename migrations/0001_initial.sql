-- quantd state, version 1: jobs, their stages and tasks, events, calibration amax rows and
-- per-tensor quality statistics. Times are Unix milliseconds. States are the names the API uses.

CREATE TABLE jobs (
  id           INTEGER PRIMARY KEY,
  request_id   TEXT UNIQUE,                 -- client's idempotency key (NULL when none was given)
  spec_json    TEXT NOT NULL,               -- the validated job spec
  state        TEXT NOT NULL CHECK (state IN
                 ('PENDING', 'RUNNING', 'PAUSED', 'SUCCEEDED', 'FAILED', 'CANCELLED')),
  reason       TEXT NOT NULL DEFAULT '',    -- machine-readable reason for the state
  error        TEXT NOT NULL DEFAULT '',    -- last error message, '' when none
  created_ms   INTEGER NOT NULL,
  updated_ms   INTEGER NOT NULL,
  started_ms   INTEGER,
  finished_ms  INTEGER
) STRICT;
CREATE INDEX jobs_by_state ON jobs(state, id);

CREATE TABLE stages (
  id           INTEGER PRIMARY KEY,
  job_id       INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
  ordinal      INTEGER NOT NULL,            -- run order within the job
  kind         TEXT NOT NULL CHECK (kind IN
                 ('inspect', 'dequant', 'calibrate', 'quantize', 'export', 'verify')),
  state        TEXT NOT NULL CHECK (state IN ('PENDING', 'RUNNING', 'SUCCEEDED', 'FAILED')),
  started_ms   INTEGER,
  finished_ms  INTEGER,
  UNIQUE (job_id, ordinal)
) STRICT;

CREATE TABLE tasks (
  id                INTEGER PRIMARY KEY,
  job_id            INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
  stage_id          INTEGER NOT NULL REFERENCES stages(id) ON DELETE CASCADE,
  ordinal           INTEGER NOT NULL,       -- order within the stage
  name              TEXT NOT NULL,          -- unit of work, e.g. the output shard's file name
  payload_json      TEXT NOT NULL,          -- what the stage needs to run this task
  bytes_total       INTEGER NOT NULL,       -- bytes the task will process (progress, ETA)
  state             TEXT NOT NULL CHECK (state IN ('PENDING', 'LEASED', 'DONE', 'FAILED')),
  attempt           INTEGER NOT NULL DEFAULT 0,  -- attempts started so far
  lease_owner       TEXT,                   -- worker holding the lease while LEASED
  lease_expires_ms  INTEGER,                -- the scheduler requeues the task after this
  not_before_ms     INTEGER NOT NULL DEFAULT 0,  -- retry back-off: not leased before this
  output_path       TEXT,
  output_bytes      INTEGER,
  output_sha256     TEXT,
  error             TEXT NOT NULL DEFAULT '',
  started_ms        INTEGER,
  finished_ms       INTEGER,
  UNIQUE (stage_id, ordinal)
) STRICT;
CREATE INDEX tasks_by_job_state ON tasks(job_id, state);

CREATE TABLE events (
  id       INTEGER PRIMARY KEY,
  job_id   INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
  at_ms    INTEGER NOT NULL,
  kind     TEXT NOT NULL,                   -- e.g. 'state', 'task_done', 'task_failed', 'retry'
  message  TEXT NOT NULL
) STRICT;
CREATE INDEX events_by_job ON events(job_id, id);

-- Calibration results: max |x| per quantized module input (or KV cache), max-reduced over samples.
CREATE TABLE amax (
  job_id   INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
  module   TEXT NOT NULL,
  kind     TEXT NOT NULL CHECK (kind IN ('input', 'kv')),
  value    REAL NOT NULL CHECK (value >= 0),
  samples  INTEGER NOT NULL,                -- calibration tokens that reached the module
  PRIMARY KEY (job_id, module, kind)
) STRICT;

-- Quantization error of each output tensor against its source, written by verify.
CREATE TABLE tensor_stats (
  job_id       INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
  tensor       TEXT NOT NULL,
  rel_rmse     REAL NOT NULL,
  sqnr_db      REAL NOT NULL,
  max_abs_err  REAL NOT NULL,
  PRIMARY KEY (job_id, tensor)
) STRICT;
