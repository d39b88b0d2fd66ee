"""Issue 19 item 1, against the real daemon: a job opens the directories it writes once, right after
their paths were checked, and writes only beneath those handles (checkpoint/dir_handle.h). A
directory swapped for a symbolic link into another tenant's model while the job runs fails the
job naming the field; the other tenant's files keep every byte.

The other tenant's files belong to a bare uid (no passwd entry needed, as in test_access.py) and
are 0600: the daemon runs as root here, so only the handles keep it from writing through them.
"""

import hashlib
import json
import os
from pathlib import Path

import grpc
import pytest

from daemon import Daemon, serving_daemon
from job_client import DEFAULT_SPEC, RPC_TIMEOUT_S, WATCH_TIMEOUT_S, JobClient

BOB = 47912  # the other tenant
DATA = Path(__file__).resolve().parents[1] / "data" / "calibration_sample.jsonl"


@pytest.fixture(scope="module")
def daemon(qd, tmp_path_factory):
    yield from serving_daemon(qd.binary, tmp_path_factory.mktemp("safety-handles") / "state")


@pytest.fixture(scope="module")
def client(daemon, stubs):
    return JobClient(stubs, daemon.channel())


def digest_tree(root):
    """Relative path -> (SHA-256, mode, uid) of every file under `root`."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            out[str(p.relative_to(root))] = (hashlib.sha256(p.read_bytes()).hexdigest(),
                                             st.st_mode & 0o777, st.st_uid)
    return out


def bobs_model(qd, root):
    """Bob's converted model: a quantized fixture whose files are his, mode 0600."""
    model = root / "bob-model"
    qd.run_ok("mkfixture", "--arch", "deepseek-v4", "--preset", "tiny", "--seed", 9, model)
    for p in [model, *model.rglob("*")]:
        os.chown(p, BOB, BOB)
        p.chmod(0o700 if p.is_dir() else 0o600)
    return model


def swap_when(client, job_id, stage, path, target, tasks_done=0):
    """Once `stage` of the job is running (and has `tasks_done` tasks done), renames `path` away
    and puts a symbolic link to `target` in its place. Returns the job's last snapshot."""
    pb = client.pb
    swapped = False
    last = None
    for last in client.stub.WatchJob(pb.WatchJobRequest(id=job_id), timeout=WATCH_TIMEOUT_S):
        if not swapped and any(s.kind == stage and s.tasks_done >= tasks_done and
                               (s.state == pb.StageProgress.RUNNING or s.tasks_done > 0)
                               for s in last.stages):
            path.rename(path.with_name(path.name + ".real"))
            path.symlink_to(target)
            swapped = True
    assert swapped, last
    return last


def test_output_swapped_for_a_link_into_another_model_fails_the_job(qd, client, tmp_path):
    """The issue's "destroy another tenant's model": alice's output replaced, after her job
    started, by a link to bob's model directory. Before: the job SUCCEEDED and bob's shards,
    config.json and index were overwritten. Now: the job FAILS naming output; bob's files keep
    their bytes, modes and owner, and nothing new appears there."""
    pb = client.pb
    bob = bobs_model(qd, tmp_path)
    before = digest_tree(bob)
    small = tmp_path / "small"
    qd.run_ok("mkfixture", "--arch", "deepseek-v4", "--preset", "small", "--seed", 3, small)
    out = tmp_path / "alice-out"
    job = client.submit(source=str(small), output=str(out))
    # Between two shards: the next one would be written through the link.
    final = swap_when(client, job.id, "quantize", out, bob, tasks_done=1)
    assert digest_tree(bob) == before
    assert sorted(p.name for p in bob.iterdir()) == sorted(before)
    assert final.state == pb.FAILED, final
    assert f"output: {out} " in final.last_error, final.last_error
    assert "the job writes only into the directory it checked" in final.last_error
    # What the job wrote stayed in the directory it had opened.
    assert (out.with_name("alice-out.real") / ".quantd-job").is_file()


def test_amax_out_directory_swapped_for_a_link_fails_the_job(qd, client, tmp_path):
    """The issue's overwrite through a swapped parent of calibration.amax_out: bob's amax.json
    keeps its bytes; the job FAILS naming calibration.amax_out."""
    pb = client.pb
    model = tmp_path / "model"
    qd.run_ok("mkfixture", "--arch", "deepseek-v4", "--preset", "tiny", "--seed", 5, model)
    bob = tmp_path / "bob"
    bob.mkdir()
    (bob / "amax.json").write_text('{"bob": 1}\n')
    os.chown(bob / "amax.json", BOB, BOB)
    (bob / "amax.json").chmod(0o600)
    before = digest_tree(bob)
    cal = tmp_path / "cal"
    cal.mkdir()
    job = client.submit(source=str(model), output=str(tmp_path / "out"), weight_format="nvfp4",
                        calibration=pb.CalibrationSpec(dataset=str(DATA), num_samples=8,
                                                       seq_len=48, amax_out=str(cal / "amax.json")))
    final = swap_when(client, job.id, "calibrate", cal, bob)
    assert digest_tree(bob) == before
    assert sorted(p.name for p in bob.iterdir()) == ["amax.json"]
    assert final.state == pb.FAILED, final
    assert f"calibration.amax_out: {cal} " in final.last_error, final.last_error


def test_source_swapped_before_export_fails_the_job_and_copies_nothing_of_bobs(qd, client,
                                                                               tmp_path):
    """The issue's "copy bob's 0600 file into her output by swapping the source directory before
    export": export re-resolved the source and copied what lay behind the link. Now the source is
    the directory opened when the job started: the job FAILS naming source, and no file of bob's
    reaches alice's output."""
    pb = client.pb
    src = tmp_path / "alice-src"
    qd.run_ok("mkfixture", "--arch", "deepseek-v4", "--preset", "small", "--seed", 3, src)
    bob = tmp_path / "bob-model"
    qd.run_ok("mkfixture", "--arch", "deepseek-v4", "--preset", "small", "--seed", 3, bob)
    (bob / "secret-notes.txt").write_text("bob's secret\n")
    os.chown(bob / "secret-notes.txt", BOB, BOB)
    (bob / "secret-notes.txt").chmod(0o600)
    out = tmp_path / "alice-out"
    job = client.submit(source=str(src), output=str(out))
    final = swap_when(client, job.id, "quantize", src, bob, tasks_done=1)
    assert not list(out.rglob("secret-notes.txt"))
    assert final.state == pb.FAILED, final
    assert f"source: {src} " in final.last_error, final.last_error


ALICE_TOKEN = "alice-token-0123456789abcdef"


@pytest.fixture(scope="module")
def alice(qd, stubs, tmp_path_factory):
    """A daemon on loopback TCP where alice's token is an admin confined to her own directory
    (allowed_roots), and a caller that sends it."""
    root = tmp_path_factory.mktemp("tenants")
    home = root / "alice"
    home.mkdir()
    token = root / "alice.token"
    token.write_text(ALICE_TOKEN + "\n")
    token.chmod(0o600)
    (root / "access.json").write_text(json.dumps({"callers": [
        {"token_file": str(token), "role": "admin", "allowed_roots": [str(home)]}]}))
    d = Daemon(qd.binary, root / "state", "--listen", "127.0.0.1:0", "--access-config",
               root / "access.json")
    d.start()
    channel = grpc.insecure_channel(d.tcp_address)
    d.channels.append(channel)
    pb, pb_grpc = stubs
    yield {"root": root, "home": home, "pb": pb, "stub": pb_grpc.QuantServiceStub(channel)}
    try:
        d.stop()
    finally:
        d.close()


def alice_runs(alice, **fields):
    """Alice submits DEFAULT_SPEC updated with `fields`; returns the job's last snapshot."""
    pb, stub = alice["pb"], alice["stub"]
    metadata = (("authorization", "Bearer " + ALICE_TOKEN),)
    job = stub.SubmitJob(pb.SubmitJobRequest(spec=pb.JobSpec(**{**DEFAULT_SPEC, **fields})),
                         metadata=metadata, timeout=RPC_TIMEOUT_S)
    last = None
    for last in stub.WatchJob(pb.WatchJobRequest(id=job.id), metadata=metadata,
                              timeout=WATCH_TIMEOUT_S):
        pass
    return last


def test_source_of_links_to_another_tenants_shards_fails_the_job(qd, alice):
    """The issue's "read another tenant's model": alice's source directory holds only symbolic
    links to bob's 0600 files. Before: the job quantized them and wrote a BF16 copy into alice's
    output. Now: the job FAILS naming source and the first file that leads outside her roots, and
    nothing of bob's reaches her output or her BF16 copy."""
    pb, home = alice["pb"], alice["home"]
    bob = bobs_model(qd, alice["root"])
    src = home / "src"
    src.mkdir()
    for p in bob.iterdir():
        (src / p.name).symlink_to(p)
    out, bf16 = home / "out", home / "bf16"
    final = alice_runs(alice, source=str(src), output=str(out), materialize_bf16=str(bf16))
    assert final.state == pb.FAILED, final
    assert (f"source: {src}/config.json leads outside the allowed roots of the caller that "
            "submitted the job") in final.last_error, final.last_error
    assert str(bob) not in final.last_error
    bobs = {h for h, _, _ in digest_tree(bob).values()}
    for d in (out, bf16):
        if d.exists():
            assert [name for name, (h, _, _) in digest_tree(d).items() if h in bobs] == []
            assert not list(d.glob("*.safetensors")), sorted(p.name for p in d.iterdir())

    # A link to a shard alone (config.json and the index alice's own) is refused too.
    mixed = home / "mixed"
    mixed.mkdir()
    for p in bob.iterdir():
        if p.suffix == ".safetensors":
            (mixed / p.name).symlink_to(p)
        else:
            (mixed / p.name).write_bytes(p.read_bytes())
    shard = sorted(p.name for p in bob.glob("*.safetensors"))[0]
    final = alice_runs(alice, source=str(mixed), output=str(home / "out-mixed"))
    assert final.state == pb.FAILED, final
    assert f"source: {mixed}/{shard} leads outside the allowed roots" in final.last_error, \
        final.last_error


def test_hugging_face_cache_snapshot_inside_the_roots_converts(qd, alice):
    """A Hugging Face cache snapshot, whose files link to ../../blobs/<hash>, works when the cache
    lies inside the caller's allowed roots."""
    pb, home = alice["pb"], alice["home"]
    model = alice["root"] / "fixture"
    qd.run_ok("mkfixture", "--arch", "deepseek-v4", "--preset", "tiny", "--seed", 11, model)
    cache = home / "hub" / "models--acme--tiny"
    blobs, snapshot = cache / "blobs", cache / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for p in model.iterdir():
        blob = hashlib.sha256(p.read_bytes()).hexdigest()
        (blobs / blob).write_bytes(p.read_bytes())
        (snapshot / p.name).symlink_to(Path("../../blobs") / blob)
    out = home / "hf-out"
    final = alice_runs(alice, source=str(snapshot), output=str(out))
    assert final.state == pb.SUCCEEDED, final
    assert list(out.glob("*.safetensors")), sorted(p.name for p in out.iterdir())
