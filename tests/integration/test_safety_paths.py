"""Issue 9 items 1 and 2, against the real daemon: no spelling of a path lets a job write into its
source, into another job's output or over files quantd did not write.

Each test reproduces one failure of the issue and asserts the fix: the submit is refused (or the
job FAILS before any task runs) with an error naming the field or the file, and the bytes on disk
are unchanged. Connections go through daemon.Daemon's helpers only.
"""

import hashlib
import os
import signal
import subprocess
from pathlib import Path

import grpc
import pytest

from daemon import Daemon, serving_daemon
from job_client import RPC_TIMEOUT_S, WATCH_TIMEOUT_S, JobClient
from run_helpers import MARKER, tree_hashes

DATA = Path(__file__).resolve().parents[1] / "data" / "calibration_sample.jsonl"

class Client(JobClient):
    def refused(self, code, **spec):
        with pytest.raises(grpc.RpcError) as info:
            self.submit(**spec)
        assert info.value.code() == code, (info.value.code(), info.value.details())
        return info.value

    def delete(self, job_id):
        self.stub.DeleteJob(self.pb.DeleteJobRequest(id=job_id), timeout=RPC_TIMEOUT_S)


@pytest.fixture(scope="module")
def daemon(qd, tmp_path_factory):
    yield from serving_daemon(qd.binary, tmp_path_factory.mktemp("safety-paths") / "state")


@pytest.fixture(scope="module")
def client(daemon, stubs):
    return Client(stubs, daemon.channel())


def digest_tree(root):
    """Relative path -> SHA-256 of every file under `root` (recursive), symlinks as their target."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(root))] = "-> " + os.readlink(p)
        elif p.is_file():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# --- 1. the source is never an output ------------------------------------------------------------

@pytest.mark.parametrize("spelling", ["same", "slash", "dot-slash", "symlink", "inside",
                                      "containing"])
def test_output_overlapping_the_source_is_refused(client, model, tmp_path, spelling):
    link = tmp_path / "model-link"
    link.symlink_to(model)
    before = digest_tree(model.parent)
    output = {"same": str(model), "slash": f"{model}/", "dot-slash": f"{model}/./",
              "symlink": str(link), "inside": str(model / "quantized"),
              "containing": str(model.parent)}[spelling]
    err = client.refused(grpc.StatusCode.INVALID_ARGUMENT, source=str(model), output=output)
    how = {"inside": "lies inside", "containing": "contains"}.get(spelling, "is")
    assert err.details().startswith(f"SubmitJobRequest.spec: output: "), err.details()
    assert f" {how} the source directory {model}" in err.details(), err.details()
    assert digest_tree(model.parent) == before


def test_materialize_bf16_overlapping_source_or_output_is_refused(client, model, tmp_path):
    before = digest_tree(model)
    out = tmp_path / "out"
    err = client.refused(grpc.StatusCode.INVALID_ARGUMENT, source=str(model), output=str(out),
                         materialize_bf16=f"{model}/")
    assert f"materialize_bf16: {model} is the source directory {model}" in err.details()
    err = client.refused(grpc.StatusCode.INVALID_ARGUMENT, source=str(model), output=str(out),
                         materialize_bf16=str(out / "bf16"))
    assert f"lies inside the output directory {out}" in err.details(), err.details()
    assert digest_tree(model) == before
    assert not out.exists()


def test_calibration_paths_are_resolved_and_amax_out_never_overwrites_an_input(client, stubs,
                                                                             model, tmp_path):
    """calibration.datasets[*].path and calibration.amax_out, reachable over gRPC, get the rules
    of the other paths; amax_out (a file the job writes) is never in the source or an input."""
    pb = stubs[0]
    before = digest_tree(model)
    out = str(tmp_path / "out")
    dataset = tmp_path / "cal.jsonl"
    dataset.write_text('{"text": "hello"}\n')

    def refused(code, **calibration):
        err = client.refused(code, source=str(model), output=out,
                             calibration=pb.CalibrationSpec(**calibration))
        assert dict(err.trailing_metadata())["quantd-reason"] == "INVALID_SPEC"
        return err.details()

    relative = pb.CalibrationDataset(path="cal.jsonl")
    assert refused(grpc.StatusCode.INVALID_ARGUMENT,
                   datasets=[pb.CalibrationDataset(path=str(dataset)), relative]) == (
        "SubmitJobRequest.spec: calibration.datasets[1].path: must be an absolute path (the "
        "daemon does not know the caller's directory)")
    (tmp_path / "model-link").symlink_to(model)
    assert refused(grpc.StatusCode.INVALID_ARGUMENT,
                   amax_out=str(tmp_path / "model-link" / "amax.json")) == (
        f"SubmitJobRequest.spec: calibration.amax_out: {model}/amax.json lies inside the source "
        f"directory {model}")
    assert refused(grpc.StatusCode.INVALID_ARGUMENT,
                   datasets=[pb.CalibrationDataset(path=str(dataset), samples=1)],
                   amax_out=f"{tmp_path}/./cal.jsonl") == (
        f"SubmitJobRequest.spec: calibration.amax_out: {dataset} is calibration.datasets[0].path; "
        "the job would overwrite its input")
    (tmp_path / "dir").mkdir()
    assert refused(grpc.StatusCode.INVALID_ARGUMENT, amax_out=str(tmp_path / "dir")) == (
        f"SubmitJobRequest.spec: calibration.amax_out: {tmp_path}/dir is a directory; name the "
        "file to write")
    assert digest_tree(model) == before
    assert dataset.read_text() == '{"text": "hello"}\n'


def test_quantctl_relative_spelling_of_the_source_is_refused(qd, daemon, model):
    """The issue's command line: --source model --output model/ from the parent directory."""
    quantctl = Path(qd.binary).parents[1] / "client" / "quantctl"
    before = digest_tree(model)
    proc = subprocess.run([str(quantctl), "--server", daemon.address, "submit", "--source",
                           "model", "--output", "model/", "--weight-format", "w4a16_nvfp4",
                           "--watch"], cwd=model.parent, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("quantctl: INVALID_ARGUMENT: "), proc.stderr
    assert f"output: {model} is the source directory {model}" in proc.stderr, proc.stderr
    assert digest_tree(model) == before


def test_paths_longer_than_path_max_or_not_utf8_are_invalid_arguments(qd, client, daemon, model,
                                                                       tmp_path):
    huge = "/" + "a" * (3_800_000)  # the 3.8 MB path
    err = client.refused(grpc.StatusCode.INVALID_ARGUMENT, source=huge, output=str(tmp_path / "o"))
    assert "field 'source'" in err.details() and "PATH_MAX" in err.details(), err.details()[:300]
    assert len(err.details()) < 300
    err = client.refused(grpc.StatusCode.INVALID_ARGUMENT, source=str(model),
                         output=str(tmp_path / "o"), exclude=["x" * 2000])
    assert "field 'exclude' glob 0 is 2000 bytes, more than 1024" in err.details(), \
        err.details()[:300]
    # Invalid UTF-8 cannot travel in a proto3 string: quantctl refuses it, naming the field.
    quantctl = Path(qd.binary).parents[1] / "client" / "quantctl"
    proc = subprocess.run([str(quantctl).encode(), b"--server", daemon.address.encode(), b"submit",
                           b"--source", str(model).encode(), b"--output", b"/tmp/\xff\xfe"],
                          capture_output=True, timeout=60)
    assert proc.returncode == 2, proc
    assert b"output: is not valid UTF-8" in proc.stderr, proc.stderr


# --- 2. files quantd did not write ----------------------------------------------------------------

def test_non_empty_output_without_marker_fails_and_files_stay(client, stubs, model, tmp_path):
    pb = stubs[0]
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "draft.tmp").write_text("also mine")
    (out / "config.json").write_text('{"mine": true}')
    before = digest_tree(out)
    job = client.finish(client.submit(source=str(model), output=str(out)).id)
    assert job.state == pb.FAILED, job
    assert f"output: {out} is not empty (3 entries) and holds no quantd marker" in job.last_error
    assert digest_tree(out) == before  # nothing added, not even the marker

    # overwrite: allowed next to foreign files, never over them.
    job = client.finish(client.submit(source=str(model), output=str(out), overwrite=True).id)
    assert job.state == pb.FAILED, job
    assert f"output: {out}/config.json was there before quantd claimed the directory" in \
        job.last_error, job.last_error
    after = digest_tree(out)
    assert {k: v for k, v in after.items() if k != MARKER} == before

    (out / "config.json").unlink()
    before = digest_tree(out)
    del before[MARKER]
    job = client.finish(client.submit(source=str(model), output=str(out), overwrite=True).id)
    assert job.state == pb.SUCCEEDED, job
    after = digest_tree(out)
    # The foreign files (a .tmp one included: the sweep passes it over) are untouched.
    assert {k: after[k] for k in ("notes.txt", "draft.tmp")} == \
        {k: before[k] for k in ("notes.txt", "draft.tmp")}


def test_another_jobs_output_is_refused_until_that_job_is_deleted(client, stubs, model, tmp_path):
    pb = stubs[0]
    out = tmp_path / "out"
    first = client.finish(client.submit("paths-first", source=str(model), output=str(out)).id)
    assert first.state == pb.SUCCEEDED, first
    before = tree_hashes(out)
    for output in (str(out), f"{out}/./", str(out / "nested")):
        err = client.refused(grpc.StatusCode.FAILED_PRECONDITION, source=str(model), output=output)
        assert f"an output of job {first.id}" in err.details(), err.details()
        assert dict(err.trailing_metadata())["quantd-reason"] == "OUTPUT_IN_USE"
    # Nor may another job write its amax table there.
    err = client.refused(grpc.StatusCode.FAILED_PRECONDITION, source=str(model),
                         output=str(tmp_path / "other"),
                         calibration=pb.CalibrationSpec(amax_out=str(out / "amax.json")))
    assert err.details() == (f"SubmitJobRequest.spec: calibration.amax_out: {out}/amax.json lies "
                             f"inside {out}, an output of job {first.id} (delete that job first "
                             "to reuse its directory)")
    # An idempotent resubmission is the same job, not a second writer.
    assert client.submit("paths-first", source=str(model), output=str(out)).id == first.id
    assert tree_hashes(out) == before
    client.delete(first.id)
    # Deleted: the directory is no longer claimed by a job, but it holds that job's files and
    # marker, so a new job there fails instead of replacing them.
    job = client.finish(client.submit(source=str(model), output=str(out)).id)
    assert job.state == pb.FAILED and f"holds the output of job {first.id}" in job.last_error, job
    assert tree_hashes(out) == before


def test_another_jobs_amax_out_is_refused_until_that_job_is_deleted(client, stubs, model,
                                                                     tmp_path):
    """calibration.amax_out is claimed like an output: the issue's second job took over a
    succeeded job's amax table. (A W4A16 job names it without writing it: it claims it all the
    same.)"""
    pb = stubs[0]
    amax = tmp_path / "cal" / "amax.json"
    first = client.finish(client.submit(source=str(model), output=str(tmp_path / "a"),
                                        calibration=pb.CalibrationSpec(amax_out=str(amax))).id)
    assert first.state == pb.SUCCEEDED, first
    claimed = (f"the calibration.amax_out of job {first.id} (delete that job first to reuse its "
               "file)")
    for output, amax_out, how in ((tmp_path / "b", amax, "is"),
                                  (tmp_path / "cal", tmp_path / "other.json", "contains")):
        err = client.refused(grpc.StatusCode.FAILED_PRECONDITION, source=str(model),
                             output=str(output), overwrite=True,
                             calibration=pb.CalibrationSpec(amax_out=str(amax_out)))
        assert dict(err.trailing_metadata())["quantd-reason"] == "OUTPUT_IN_USE"
        field = "calibration.amax_out" if how == "is" else "output"
        path = amax_out if how == "is" else output
        assert err.details() == (f"SubmitJobRequest.spec: {field}: {path} {how} {amax}, "
                                 f"{claimed}"), err.details()
    client.delete(first.id)
    job = client.finish(client.submit(source=str(model), output=str(tmp_path / "b"),
                                      calibration=pb.CalibrationSpec(amax_out=str(amax))).id)
    assert job.state == pb.SUCCEEDED, job
    client.delete(job.id)


def test_two_daemons_naming_one_amax_out_never_replace_each_others_table(qd, client, stubs,
                                                                          model, tmp_path):
    """Issue 19 item 6: each daemon's admission knows only its own store, so two daemons both
    accepted an absent calibration.amax_out and the later writer silently replaced the first's
    table. Daemon B's job is loaded while the file is absent, then B is killed at its first
    calibrate task; daemon A's job writes its table; B restarts and resumes: its table is renamed
    into place without replacing, so B's job FAILS with OUTPUT_EXISTS and A's table keeps its
    bytes."""
    pb = stubs[0]
    (tmp_path / "cal").mkdir()
    amax = tmp_path / "cal" / "amax.json"

    def spec(output, samples):
        return dict(source=str(model), output=str(tmp_path / output), weight_format="nvfp4",
                    calibration=pb.CalibrationSpec(dataset=str(DATA), num_samples=samples,
                                                   seq_len=48, amax_out=str(amax)))

    other = Daemon(qd.binary, tmp_path / "state-b", env={"QUANTD_TEST_KILL_AT": "calibrate:1"})
    try:
        other.start()
        late = Client(stubs, other.channel()).submit(**spec("b", 8))
        assert other.wait(120) == -signal.SIGKILL, other.log()
        assert not amax.exists()

        first = client.finish(client.submit(**spec("a", 6)).id)
        assert first.state == pb.SUCCEEDED, first
        table = amax.read_bytes()

        other.env = {}
        other.start()
        final = Client(stubs, other.channel()).finish(late.id)
        assert final.state == pb.FAILED, final
        assert final.reason == "OUTPUT_EXISTS", final
        assert (f"calibration.amax_out: {amax} was written by another job while this one ran"
                in final.last_error), final.last_error
        assert amax.read_bytes() == table
        other.stop()
    finally:
        other.close()


def test_an_amax_out_quantd_did_not_write_is_replaced_only_with_overwrite(client, stubs, model,
                                                                           tmp_path):
    """An existing file at calibration.amax_out is replaced only when a job of this daemon wrote
    it (a finished task recorded its path, size and SHA-256), or with overwrite."""
    pb = stubs[0]
    foreign = tmp_path / "notes.json"
    foreign.write_text('{"mine": true}\n')
    err = client.refused(grpc.StatusCode.FAILED_PRECONDITION, source=str(model),
                         output=str(tmp_path / "a"),
                         calibration=pb.CalibrationSpec(amax_out=str(foreign)))
    assert dict(err.trailing_metadata())["quantd-reason"] == "OUTPUT_EXISTS"
    assert err.details() == (f"calibration.amax_out: {foreign} exists and no job of this quantd "
                             "wrote it; set overwrite to replace it")
    job = client.finish(client.submit(source=str(model), output=str(tmp_path / "a"),
                                      overwrite=True,
                                      calibration=pb.CalibrationSpec(amax_out=str(foreign))).id)
    assert job.state == pb.SUCCEEDED, job  # W4A16: accepted, and it writes no amax table
    client.delete(job.id)
    assert foreign.read_text() == '{"mine": true}\n'

    # A calibrating job writes the table, then fails its quality gate: FAILED, it no longer
    # claims the file, and the file is quantd's.
    amax = tmp_path / "amax.json"
    data = Path(__file__).resolve().parents[1] / "data" / "calibration_sample.jsonl"
    writer = client.finish(client.submit(
        source=str(model), output=str(tmp_path / "w4a4"), weight_format="nvfp4",
        calibration=pb.CalibrationSpec(dataset=str(data), num_samples=8, seq_len=48,
                                       amax_out=str(amax)),
        evaluate=pb.EvaluateSpec(num_samples=4, gate=pb.QualityGate(max_mean_kl=0))).id)
    assert writer.state == pb.FAILED and writer.reason == "QUALITY_GATE", writer
    written = amax.read_bytes()
    amax.write_bytes(written + b" ")  # changed since: no longer what quantd wrote
    err = client.refused(grpc.StatusCode.FAILED_PRECONDITION, source=str(model),
                         output=str(tmp_path / "b"),
                         calibration=pb.CalibrationSpec(amax_out=str(amax)))
    assert dict(err.trailing_metadata())["quantd-reason"] == "OUTPUT_EXISTS"
    amax.write_bytes(written)
    job = client.finish(client.submit(source=str(model), output=str(tmp_path / "b"),
                                      calibration=pb.CalibrationSpec(amax_out=str(amax))).id)
    assert job.state == pb.SUCCEEDED, job
    client.delete(job.id)
    client.delete(writer.id)


def test_two_daemons_never_write_one_output(qd, stubs, source, tmp_path):
    """The issue's corrupt shard: a second daemon (its own state dir) targets the output that a
    first daemon's job is writing. The marker's lock (and its job id) refuse the second job."""
    pb = stubs[0]
    small = tmp_path / "small"
    qd.run_ok("mkfixture", "--arch", "deepseek-v4", "--preset", "small", "--seed", 3, small)
    out = tmp_path / "out"
    with Daemon(qd.binary, tmp_path / "a") as a, Daemon(qd.binary, tmp_path / "b") as b:
        ca, cb = Client(stubs, a.channel()), Client(stubs, b.channel())
        first = ca.submit(source=str(small), output=str(out))
        for snapshot in ca.stub.WatchJob(pb.WatchJobRequest(id=first.id), timeout=WATCH_TIMEOUT_S):
            if any(s.kind == "quantize" and s.bytes_done > 0 for s in snapshot.stages):
                break
        second = cb.finish(cb.submit(source=str(small), output=str(out)).id)
        assert second.state == pb.FAILED, second
        assert ("is being written by another quantd process" in second.last_error or
                "holds the output of job" in second.last_error), second.last_error
        done = ca.finish(first.id)
        assert done.state == pb.SUCCEEDED, done
    assert qd.run("verify", out).returncode == 0



def test_a_path_swapped_for_a_symlink_after_submit_is_refused_at_resume(qd, stubs, model,
                                                                        tmp_path):
    """Paths are resolved at submit; one swapped for a symlink afterwards (here: the output,
    while the daemon was down mid-job) would lead the resumed job out of the caller's allowed
    roots. The job fails at its start naming the link; nothing is written behind it."""
    pb = stubs[0]
    out = tmp_path / "out"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    d = Daemon(qd.binary, tmp_path / "state", env={"QUANTD_TEST_KILL_AT": "quantize:1:mid"})
    with d:
        job = Client(stubs, d.channel()).submit(source=str(model), output=str(out))
        assert d.wait(60) == -9, d.log()
        out.rename(tmp_path / "out.real")
        out.symlink_to(elsewhere)
        d.env = {}
        d.start()
        final = Client(stubs, d.channel()).finish(job.id)
        assert final.state == pb.FAILED, final
        assert (f"output: {out} now leads through the symbolic link {out} (to {elsewhere}), which "
                "was not there when the job was submitted") in final.last_error, final.last_error
        d.stop()
    assert list(elsewhere.iterdir()) == []
