"""Helpers of the integration tests: job specs, output trees, the SQLite state."""

import hashlib
import json
import sqlite3
from pathlib import Path


def write_spec(path, source, out, bf16=None, **fields):
    spec = {"source": str(source), "output": str(out), **fields}
    if bf16 is not None:
        spec["materialize_bf16"] = str(bf16)
    path.write_text(json.dumps(spec))
    return path


MARKER = ".quantd-job"  # quantd's claim on an output directory (job id, state database)


def tree_hashes(directory):
    """File name -> bytes of every file in `directory` (flat: quantd writes no subdirectories),
    but the marker, which names the job that wrote them."""
    out = {}
    for p in sorted(Path(directory).iterdir()):
        if p.name == MARKER:
            continue
        assert p.is_file(), p
        out[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def task_rows(state_path):
    """(stage kind, ordinal) -> {state, attempt, sha, name} from the SQLite state file."""
    con = sqlite3.connect(str(state_path))
    try:
        # A process killed while creating the file leaves it without tables (the migration is
        # one transaction).
        if not con.execute("SELECT 1 FROM sqlite_master WHERE name = 'tasks'").fetchall():
            return {}
        rows = con.execute(
            "SELECT s.kind, t.ordinal, t.state, t.attempt, IFNULL(t.output_sha256, ''), t.name "
            "FROM tasks t JOIN stages s ON s.id = t.stage_id ORDER BY s.ordinal, t.ordinal"
        ).fetchall()
    finally:
        con.close()
    return {(k, o): {"state": st, "attempt": a, "sha": sha, "name": n}
            for k, o, st, a, sha, n in rows}


def job_row(state_path):
    con = sqlite3.connect(str(state_path))
    try:
        return con.execute("SELECT state, reason, error FROM jobs").fetchall()
    finally:
        con.close()
