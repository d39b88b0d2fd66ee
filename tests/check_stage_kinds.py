#!/usr/bin/env python3
"""The engine special-cases no stateful stage: fails when the scheduler or PreparedJob names one.

Usage: check_stage_kinds.py REPO_ROOT   (ctest runs it as the test `stage_kinds`)

A stage keeps its per-job state, its results, its payloads and its progress to itself
(server/pipeline/stage.h: Stage::OpenJob, StageJob, StageResult, ProgressStep), so the files
CHECKED hold none of the names in FORBIDDEN: the calibrate and evaluate stages' classes and kind
literals, their per-job state types and their payload parsers. (What a report needs to know of a
stage's rows it asks the stage's header, e.g. stages/calibrate_stage.h CalibratedLayers.) EXEMPT lists the files
where such a word means something else, with the reason.
"""
import os
import re
import sys

CHECKED = ["server/scheduler", "server/pipeline/prepared_job.h", "server/pipeline/prepared_job.cc"]
FORBIDDEN = [
    r"\b(?:Calibrate|Evaluate)Stage\b",
    r'"(?:calibrate|evaluate)"',
    r"\bJob(?:Calibration|Evaluation)\b",
    r"\bParse(?:Calibrate|Evaluate)Task\b",
    r"\bEvaluateTaskOf\b",
]
EXEMPT = {
    # The JobSpec's JSON form: "evaluate" is the spec's field, not the stage's kind.
    "server/scheduler/job_proto.cc",
}
SOURCE_EXTS = (".h", ".cc")


def files(root):
    for entry in CHECKED:
        path = os.path.join(root, entry)
        if os.path.isfile(path):
            yield entry
            continue
        for dirpath, _, names in os.walk(path):
            for name in sorted(names):
                if name.endswith(SOURCE_EXTS):
                    yield os.path.relpath(os.path.join(dirpath, name), root)


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    root = sys.argv[1]
    patterns = [re.compile(p) for p in FORBIDDEN]
    found = []
    checked = 0
    for rel in files(root):
        if rel in EXEMPT:
            continue
        checked += 1
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                for pattern in patterns:
                    match = pattern.search(line)
                    if match:
                        found.append(f"{rel}:{number}: names a stage: {match.group(0)}")
    if checked == 0:
        print(f"{root}: none of {CHECKED} found", file=sys.stderr)
        return 2
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
