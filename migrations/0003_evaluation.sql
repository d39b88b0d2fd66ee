-- quantd state, version 3: the evaluate stage's figures (server/pipeline/stages/evaluate_stage.h),
-- recorded in the transaction that marks their task done; a task that runs again replaces its row.
-- A figure that is not a number is stored as NULL (SQLite stores a NaN so); infinities are stored
-- as they are.

-- One decoder layer's hidden-state SQNR of the quantized model against the source, as its two
-- sums (signal = sum ref^2, noise = sum (ref - x)^2 over every value of the layer's output), so
-- that identical outputs (noise 0: +inf dB) round-trip exactly.
CREATE TABLE evaluation_layers (
  task_id                INTEGER PRIMARY KEY REFERENCES tasks(id) ON DELETE CASCADE,
  job_id                 INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
  layer                  INTEGER NOT NULL CHECK (layer >= 0),
  free_running_signal    REAL,  -- the quantized model on its own activations
  free_running_noise     REAL,
  teacher_forced_signal  REAL,  -- the quantized layer on the source's activations
  teacher_forced_noise   REAL,
  seconds                REAL NOT NULL,  -- the task's wall time
  UNIQUE (job_id, layer)
) STRICT;

-- The job's next-token figures over all held-out tokens and the quality gate's verdict, written by
-- the stage's head task (also when the gate fails the job). Its worst layers are those of
-- evaluation_layers with the lowest teacher-forced SQNR.
CREATE TABLE evaluations (
  job_id          INTEGER PRIMARY KEY REFERENCES jobs(id) ON DELETE CASCADE,
  task_id         INTEGER NOT NULL REFERENCES tasks(id) ON DELETE CASCADE,
  samples         INTEGER NOT NULL CHECK (samples >= 0),  -- held-out samples
  tokens          INTEGER NOT NULL CHECK (tokens >= 0),
  numerics        TEXT NOT NULL,                           -- 'official' | 'math'
  positions       INTEGER NOT NULL CHECK (positions >= 0), -- compared (KL, top-1)
  predicted       INTEGER NOT NULL CHECK (predicted >= 0), -- with a next token (perplexity)
  mean_kl         REAL,                                    -- nats
  p99_kl          REAL,
  max_kl          REAL,
  top1_agreement  REAL,
  source_ppl      REAL,
  quantized_ppl   REAL,
  ppl_ratio       REAL,
  gate_passed     INTEGER NOT NULL CHECK (gate_passed IN (0, 1)),
  gate_message    TEXT NOT NULL,                           -- '' when passed
  seconds         REAL NOT NULL                            -- the stage's tasks' wall time
) STRICT;
