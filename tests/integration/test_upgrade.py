"""Upgrade from schema version 1 (issue 8 §2): a state file written by the release before migration
0002, its job PAUSED in the middle of quantize (tests/data/upgrade_v1/README.md says how it was
made), is opened by this quantd, migrated, and resumed to output byte-identical to an uninterrupted
run; the tasks the old release finished are not redone. That release wrote no .quantd-job marker:
its output directories are adopted only while they hold nothing but the job's finished outputs.
"""

import json
import shutil
import struct

import pytest
import sqlite3
from pathlib import Path

from google.protobuf import json_format

from daemon import Daemon
from run_helpers import MARKER, job_row, task_rows, tree_hashes

DATA = Path(__file__).resolve().parents[1] / "data" / "upgrade_v1"
RUN_FLAGS = ["--workers", "2", "--device", "cpu", "--threads", "1"]


def workdir(qd, root):
    """A directory with the fixture the old release converted, at the spec's relative paths."""
    root.mkdir(parents=True)
    qd.run_ok("mkfixture", "--arch", "deepseek-v4", "--preset", "tiny", "--seed", 5, root / "src")
    shutil.copy(DATA / "spec.json", root / "spec.json")
    return root


def run_in(qd, root, state):
    proc = qd.run("run", "--state", state, *RUN_FLAGS, "spec.json", cwd=root)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    return proc


def upgraded(qd, root, ref):
    """A work dir with the version-1 state file and the done tasks' outputs as the old release
    left them (their recorded SHA-256 is checked on resume: bytes from this quantd must be the
    same); returns the task rows before the upgrade and the keys of the done ones."""
    run = workdir(qd, root)
    shutil.copy(DATA / "v1_paused_mid_quantize.db", run / "state.db")
    before = task_rows(run / "state.db")
    done = {key for key, row in before.items() if row["state"] == "DONE"}
    assert [k for k in done if k[0] == "quantize"] and ("export", 0) not in done
    for key in done:
        name = before[key]["name"]
        if key[0] == "quantize":
            (run / "out").mkdir(exist_ok=True)
            shutil.copy(ref / "out" / name, run / "out" / name)
        elif key[0] == "dequant":
            (run / "bf16").mkdir(exist_ok=True)
            shutil.copy(ref / "bf16" / name, run / "bf16" / name)
    return run, before, done


@pytest.fixture(scope="module")
def reference(qd, tmp_path_factory):
    """The uninterrupted run of the same job by this quantd: the version-1 state file without
    any output the old release wrote, so that every task runs here (a DONE task whose output is
    gone is redone), on the plan the old release stored."""
    ref = workdir(qd, tmp_path_factory.mktemp("upgrade") / "ref")
    shutil.copy(DATA / "v1_paused_mid_quantize.db", ref / "state.db")
    run_in(qd, ref, "state.db")
    return ref


def test_a_version_1_paused_job_resumes_to_identical_output(qd, reference, tmp_path):
    ref = reference
    run, before, done = upgraded(qd, tmp_path / "upgraded", ref)
    assert not (run / "out" / MARKER).exists()

    proc = run_in(qd, run, "state.db")
    assert "resuming job 1: 7 of 14 tasks done" in proc.stderr + proc.stdout
    assert "adopted an output directory without a marker" in proc.stderr + proc.stdout
    assert (run / "out" / MARKER).is_file() and (run / "bf16" / MARKER).is_file()

    assert job_row(run / "state.db") == [("SUCCEEDED", "", "")]
    con = sqlite3.connect(str(run / "state.db"))
    try:
        assert con.execute("PRAGMA user_version").fetchone()[0] >= 2
    finally:
        con.close()
    after = task_rows(run / "state.db")
    assert all(row["state"] == "DONE" for row in after.values())
    for key in done:
        assert after[key]["attempt"] == 1, key  # not redone
        assert after[key]["sha"] == before[key]["sha"], key
    assert tree_hashes(run / "out") == tree_hashes(ref / "out")
    assert tree_hashes(run / "bf16") == tree_hashes(ref / "bf16")


def header_dtypes(out):
    """{tensor: dtype} over the output's shards."""
    dtypes = {}
    for shard in sorted(out.glob("*.safetensors")):
        raw = shard.read_bytes()
        header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
        dtypes.update({k: v["dtype"] for k, v in header.items() if k != "__metadata__"})
    return dtypes


def test_the_version_1_job_keeps_its_recipe_and_a_new_job_gets_the_current_one(
        qd, reference, tmp_path):
    """The old release's `full` recipe quantized attn.wo_a (recipe revision 1): the resumed job
    still does, so its output is what that release would have written; a new job of the same
    spec leaves wo_a in its source format (FP8, written decoded to BF16 in this layout)."""
    old = header_dtypes(reference / "out")
    new_run = workdir(qd, tmp_path / "new")
    run_in(qd, new_run, "state.db")
    new = header_dtypes(new_run / "out")
    for layer in range(3):
        m = f"layers.{layer}.attn.wo_a"
        assert (old[f"{m}.weight"], old[f"{m}.weight_scale"]) == ("U8", "F8_E4M3"), m
        assert new[f"{m}.weight"] == "BF16" and f"{m}.weight_scale" not in new, m
    assert {k for k in old if ".attn.wo_a." not in k} == {k for k in new if ".attn.wo_a." not in k}


@pytest.mark.parametrize("stray", ["notes.txt", "changed-output"])
def test_a_version_1_output_with_other_files_is_not_adopted(qd, reference, tmp_path, stray):
    """A file that is not a finished output of the job (or an output whose bytes changed) stops
    the adoption: the job fails naming it, and nothing in the directory changes."""
    run, before, done = upgraded(qd, tmp_path / "upgraded", reference)
    if stray == "notes.txt":
        (run / "out" / "notes.txt").write_text("mine")
        name = "notes.txt"
    else:
        name = next(before[k]["name"] for k in sorted(done) if k[0] == "quantize")
        with open(run / "out" / name, "r+b") as f:
            f.seek(100)
            f.write(b"\xff")
    files = tree_hashes(run / "out")
    proc = qd.run("run", "--state", "state.db", *RUN_FLAGS, "spec.json", cwd=run)
    assert proc.returncode != 0, (proc.stdout, proc.stderr)
    # The version-1 spec's paths are relative, and errors name them as the spec does.
    assert (f"output: out is not empty ({len(files)} entries) and holds no quantd marker; "
            f"out/{name} is not an output this job finished (with its recorded size and "
            "SHA-256), so quantd does not adopt the directory") in proc.stderr, proc.stderr
    assert tree_hashes(run / "out") == files
    assert not (run / "out" / MARKER).exists()


def test_the_report_counts_the_modules_the_old_release_quantized_without_statistics(
        qd, stubs, tmp_path):
    """The old release's verify stage computed the error statistics, this one's quantize does: the
    two quantize tasks it finished have none, and the report counts their modules instead of
    leaving their SQNR out silently."""
    pb, pb_grpc = stubs
    state = tmp_path / "state"
    state.mkdir()
    shutil.copy(DATA / "v1_paused_mid_quantize.db", state / "quantd.db")
    con = sqlite3.connect(str(state / "quantd.db"))
    try:
        payloads = con.execute(
            "SELECT t.payload_json FROM tasks t JOIN stages s ON s.id = t.stage_id "
            "WHERE s.kind = 'quantize' AND t.state = 'DONE'").fetchall()
    finally:
        con.close()
    assert len(payloads) == 2
    modules = sum(len(json.loads(p)["modules"]) for (p,) in payloads)
    assert modules > 0
    with Daemon(qd.binary, state) as daemon:
        stub = pb_grpc.QuantServiceStub(daemon.channel())
        report = stub.GetJobReport(pb.GetJobReportRequest(id=1), timeout=10)
    assert report.state == pb.PAUSED
    assert report.tensors_total == 0
    assert report.modules_without_statistics == modules


# The spec each earlier release stored (its canonical JSON; the first is the one in
# v1_paused_mid_quantize.db), and what GetJob shows for it: the spec it meant, with this release's
# defaults spelled out. server/job/job_spec.h reads the stored form; the unit test
# StoredJobSpecTest checks the same forms field by field.
STORED_SPECS = [
    ("schema 1",
     '{"calibration":{"amax_file":"","calibrate_all_experts":false,"dataset":"","num_samples":0,'
     '"seq_len":0},"devices":"auto","exclude":[],"expert_cast":"lossless",'
     '"export_format":"modelopt","host_memory_bytes":0,"kv_cache":"none",'
     '"materialize_bf16":"bf16","output":"out","recipe":"full","source":"src",'
     '"weight_format":"w4a16_nvfp4"}',
     {"source": "src", "output": "out", "materialize_bf16": "bf16", "recipe": "full",
      "weight_format": "w4a16_nvfp4"}),
    ("overwrite and a custom recipe",
     '{"calibration":{"amax_file":"","calibrate_all_experts":true,"dataset":"/d.jsonl",'
     '"num_samples":64,"seq_len":512},"devices":["cpu"],"exclude":["*.wo_b"],'
     '"expert_cast":"requantize","export_format":"compressed-tensors",'
     '"host_memory_bytes":1073741824,"include":["layers.*"],"kv_cache":"fp8","output":"/o",'
     '"overwrite":true,"source":"/s","weight_format":"nvfp4"}',
     {"source": "/s", "output": "/o", "recipe": "custom", "include": ["layers.*"],
      "exclude": ["*.wo_b"], "expert_cast": "requantize", "export_format": "compressed-tensors",
      "kv_cache": "fp8", "devices": ["cpu"], "host_memory_bytes": "1073741824",
      "overwrite": True,
      "calibration": {"calibrate_all_experts": True, "dataset": "/d.jsonl",
                      "num_samples": "64"}}),
    ("calibration datasets",
     '{"calibration":{"add_bos":false,"amax_file":"","calibrate_all_experts":false,"dataset":"",'
     '"datasets":[{"path":"/d/a.jsonl","samples":100},{"path":"/d/b.jsonl","samples":0}],'
     '"min_seq_len":8,"num_samples":200,"seed":3,"seq_len":256},"devices":"auto","exclude":[],'
     '"expert_cast":"lossless","export_format":"modelopt","host_memory_bytes":0,'
     '"kv_cache":"none","output":"/o","recipe":"experts","source":"/s","weight_format":"nvfp4"}',
     {"source": "/s", "output": "/o",
      "calibration": {"add_bos": False, "min_seq_len": "8", "num_samples": "200", "seed": "3",
                      "seq_len": "256",
                      "datasets": [{"path": "/d/a.jsonl", "samples": "100"},
                                   {"path": "/d/b.jsonl"}]}}),
    ("calibration export options",
     '{"calibration":{"add_bos":true,"amax_file":"/a.json","amax_out":"/t.json",'
     '"calibrate_all_experts":false,"dataset":"","expert_amax":"layer_max","min_seq_len":16,'
     '"mode":"constant","num_samples":0,"numerics":"math","seed":0,"seq_len":512,'
     '"uncalibrated":"model_max","w2_input":"weighted"},"devices":["cuda:0","cuda:1"],'
     '"exclude":[],"expert_cast":"lossless","export_format":"modelopt","host_memory_bytes":0,'
     '"kv_cache":"fp8_cast","output":"/o","recipe":"experts","source":"/s",'
     '"weight_format":"nvfp4"}',
     {"source": "/s", "output": "/o", "kv_cache": "fp8_cast", "devices": ["cuda:0", "cuda:1"],
      "calibration": {"amax_file": "/a.json", "amax_out": "/t.json", "expert_amax": "layer_max",
                      "mode": "constant", "numerics": "math", "uncalibrated": "model_max",
                      "w2_input": "weighted"}}),
    ("evaluate gate",
     '{"calibration":{"add_bos":true,"amax_file":"","amax_out":"","calibrate_all_experts":false,'
     '"dataset":"/d.jsonl","expert_amax":"per_expert","min_seq_len":16,"mode":"data",'
     '"num_samples":0,"numerics":"official","seed":0,"seq_len":512,"uncalibrated":"layer_max",'
     '"w2_input":"max"},"devices":"auto","evaluate":{"gate":{"max_mean_kl":0.05,'
     '"min_top1_agreement":0.9},"num_samples":8},"exclude":[],"expert_cast":"lossless",'
     '"export_format":"modelopt","host_memory_bytes":0,"kv_cache":"none","output":"/o",'
     '"recipe":"experts","source":"/s","weight_format":"nvfp4"}',
     {"source": "/s", "output": "/o", "calibration": {"dataset": "/d.jsonl"},
      "evaluate": {"num_samples": "8",
                   "gate": {"max_mean_kl": 0.05, "min_top1_agreement": 0.9}}}),
    ("checkpoint_seconds",
     '{"calibration":{"add_bos":true,"amax_file":"","amax_out":"","calibrate_all_experts":false,'
     '"checkpoint_seconds":0,"dataset":"/d.jsonl","expert_amax":"per_expert","min_seq_len":16,'
     '"mode":"data","num_samples":0,"numerics":"official","seed":0,"seq_len":512,'
     '"uncalibrated":"layer_max","w2_input":"max"},"devices":"auto","evaluate":{"gate":'
     '{"max_ppl_ratio":1.25},"num_samples":0},"exclude":[],"expert_cast":"lossless",'
     '"export_format":"modelopt","host_memory_bytes":0,"kv_cache":"none","output":"/o",'
     '"recipe":"experts","source":"/s","weight_format":"nvfp4"}',
     {"source": "/s", "output": "/o",
      "calibration": {"dataset": "/d.jsonl", "checkpoint_seconds": "0"},
      "evaluate": {"gate": {"max_ppl_ratio": 1.25}}}),
    ("evaluate enabled",
     '{"calibration":{"add_bos":true,"amax_file":"","amax_out":"","calibrate_all_experts":false,'
     '"dataset":"/d.jsonl","expert_amax":"per_expert","min_seq_len":16,"mode":"data",'
     '"num_samples":0,"numerics":"official","seed":0,"seq_len":512,"uncalibrated":"layer_max",'
     '"w2_input":"max"},"devices":"auto","evaluate":{"enabled":false,"gate":{},"num_samples":0},'
     '"exclude":[],"expert_cast":"lossless","export_format":"modelopt","host_memory_bytes":0,'
     '"kv_cache":"none","output":"/o","recipe":"experts","source":"/s","weight_format":"nvfp4"}',
     {"source": "/s", "output": "/o", "calibration": {"dataset": "/d.jsonl"},
      "evaluate": {"enabled": False}}),
    ("source_roots",
     '{"calibration":{"add_bos":true,"amax_file":"","amax_out":"","calibrate_all_experts":false,'
     '"dataset":"","expert_amax":"per_expert","min_seq_len":16,"mode":"data","num_samples":0,'
     '"numerics":"official","seed":0,"seq_len":512,"uncalibrated":"layer_max","w2_input":"max"},'
     '"devices":"auto","exclude":[],"expert_cast":"lossless","export_format":"modelopt",'
     '"host_memory_bytes":0,"kv_cache":"none","output":"/o","recipe":"experts","source":"/s",'
     '"source_roots":["/models","/hf"],"weight_format":"nvfp4"}',
     {"source": "/s", "output": "/o"}),
]

# GetJob's spec of a job with no field set: every default spelled out (proto JSON, int64 as text).
DEFAULT_SPEC = {
    "recipe": "experts", "weight_format": "nvfp4", "expert_cast": "lossless",
    "export_format": "modelopt", "kv_cache": "none",
    "calibration": {"seq_len": "512", "min_seq_len": "16", "add_bos": True, "mode": "data",
                    "w2_input": "max", "expert_amax": "per_expert", "uncalibrated": "layer_max",
                    "numerics": "official", "checkpoint_seconds": "300"},
    "evaluate": {"gate": {}},
}


def merged(base, over):
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(base[key], value) if isinstance(value, dict) and key in base else value
    return out


@pytest.mark.parametrize("release,stored,expected", STORED_SPECS, ids=[s[0] for s in STORED_SPECS])
def test_every_earlier_releases_stored_spec_reads_as_the_spec_it_meant(
        qd, stubs, tmp_path, release, stored, expected):
    """A state file whose job an earlier release stored: GetJob shows the spec that release meant
    (its defaults, seq_len 0 as 512, "devices": "auto" as every device), not an error or an empty
    spec; source_roots stays internal."""
    pb, pb_grpc = stubs
    state = tmp_path / "state"
    state.mkdir()
    shutil.copy(DATA / "v1_paused_mid_quantize.db", state / "quantd.db")
    con = sqlite3.connect(str(state / "quantd.db"))
    try:
        assert con.execute("SELECT spec_json FROM jobs").fetchone()[0] == STORED_SPECS[0][1]
        con.execute("UPDATE jobs SET spec_json = ?", (stored,))
        con.commit()
    finally:
        con.close()
    with Daemon(qd.binary, state) as daemon:
        stub = pb_grpc.QuantServiceStub(daemon.channel())
        job = stub.GetJob(pb.GetJobRequest(id=1), timeout=10)
    assert job.state == pb.PAUSED
    shown = json_format.MessageToDict(job.spec, preserving_proto_field_name=True)
    assert shown == merged(DEFAULT_SPEC, expected)
