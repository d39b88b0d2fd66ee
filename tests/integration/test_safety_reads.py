"""Issue 9 item 2 ("Reads") against the real daemon: special files, size caps, secrets and a shard
truncated under a running job. Each failure of the issue is reproduced: the job FAILS with an
error naming the file and the rule, other RPCs keep answering within a second, SIGTERM still stops
the daemon, and no error carries the content of a file.
"""

import os

import pytest

from daemon import Daemon
from job_client import WATCH_TIMEOUT_S, JobClient as Client

SECRET = "hunter2-correct-horse"


def make_fifo(path):
    path.unlink(missing_ok=True)
    os.mkfifo(path)


@pytest.mark.parametrize("target", ["config.json", "shard", "index"])
def test_fifo_in_the_source_fails_the_job_and_the_daemon_stays_responsive(qd, stubs, model,
                                                                          tmp_path, target):
    name = {"config.json": "config.json", "shard": "model-00002-of-00004.safetensors",
            "index": "model.safetensors.index.json"}[target]
    make_fifo(model / name)
    d = Daemon(qd.binary, tmp_path / "state")
    with d:
        client = Client(stubs, d.channel())
        job = client.finish(client.submit(source=str(model), output=str(tmp_path / "out")).id)
        assert job.state == client.pb.FAILED, job
        assert f"{model / name}: is a FIFO; only regular files are read" in job.last_error, job
        client.responsive(job.id)
        assert d.stop() < 10  # SIGTERM is not stuck behind a read


@pytest.mark.parametrize("special", ["fifo", "/dev/zero", "directory"])
def test_special_amax_file_fails_clearly(qd, stubs, model, tmp_path, special):
    path = {"fifo": tmp_path / "amax.json", "/dev/zero": "/dev/zero",
            "directory": tmp_path}[special]
    if special == "fifo":
        make_fifo(path)
    rule = {"fifo": "is a FIFO", "/dev/zero": "is a device", "directory": "is a directory"}[special]
    with Daemon(qd.binary, tmp_path / "state") as d:
        client = Client(stubs, d.channel())
        job = client.finish(client.submit(source=str(model), output=str(tmp_path / "out"),
                                          weight_format="nvfp4",
                                          calibration={"amax_file": str(path)}).id)
        assert job.state == client.pb.FAILED, job
        assert f"{path}: {rule}; only regular files are read" in job.last_error, job
        client.responsive(job.id)
        d.stop()


def test_dev_zero_as_config_is_refused_without_reading_it(qd, stubs, model, tmp_path):
    (model / "config.json").unlink()
    (model / "config.json").symlink_to("/dev/zero")
    with Daemon(qd.binary, tmp_path / "state") as d:
        client = Client(stubs, d.channel())
        job = client.finish(client.submit(source=str(model), output=str(tmp_path / "out")).id)
        assert job.state == client.pb.FAILED, job
        assert f"{model}/config.json: is a device; only regular files are read" in job.last_error
        d.stop()


@pytest.mark.parametrize("content", [
    '{"password": "%s"}' % SECRET,            # valid JSON whose key is the secret's name
    '{"%s": 1.0}' % SECRET,                   # the secret as a key
    '{"db_password": %s}' % SECRET,           # invalid JSON right at the secret
    "%s\n" % SECRET,                          # not JSON at all
])
def test_no_secret_in_any_error(qd, stubs, model, tmp_path, content):
    secret = tmp_path / "secret.json"
    secret.write_text(content)
    secret.chmod(0o600)
    with Daemon(qd.binary, tmp_path / "state") as d:
        client = Client(stubs, d.channel())
        job = client.finish(client.submit(source=str(model), output=str(tmp_path / "out"),
                                          weight_format="nvfp4",
                                          calibration={"amax_file": str(secret)}).id)
        assert job.state == client.pb.FAILED, job
        assert str(secret) in job.last_error, job.last_error
        for word in (SECRET, "hunter2", "password"):
            assert word not in job.last_error, job.last_error
        d.stop()
        assert SECRET not in d.log()


def test_truncated_shard_fails_the_job_not_the_daemon(qd, stubs, tmp_path):
    small = tmp_path / "small"
    qd.run_ok("mkfixture", "--arch", "deepseek-v4", "--preset", "small", "--seed", 11, small)
    shards = sorted(small.glob("model-*.safetensors"))
    last = shards[-1]
    with Daemon(qd.binary, tmp_path / "state") as d:
        client = Client(stubs, d.channel())
        pb = client.pb
        job = client.submit(source=str(small), output=str(tmp_path / "out"))
        # One CPU worker takes the shards in order: truncate the last one once quantize started.
        for snapshot in client.stub.WatchJob(pb.WatchJobRequest(id=job.id),
                                             timeout=WATCH_TIMEOUT_S):
            if any(s.kind == "quantize" and s.bytes_done > 0 for s in snapshot.stages):
                break
        os.truncate(last, last.stat().st_size // 2)
        final = client.finish(job.id)
        assert final.state == pb.FAILED, final
        assert f"{last}: the file shrank below its " in final.last_error, final.last_error
        assert d.proc.poll() is None, d.log()  # no SIGBUS
        client.responsive(job.id)
        d.stop()
