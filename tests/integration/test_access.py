"""Access control of the daemon (issue 9 §3, README "Security model") against the real binary:
the unix socket (mode 0660, its group, callers known by uid: root an admin, a second uid run
with setpriv a reader unless the access config says otherwise, allowed_roots enforced with the
field named), bearer tokens on loopback TCP (no token, a wrong one and a reader's get
UNAUTHENTICATED / PERMISSION_DENIED from a grpcio client, health and reflection stay open), mutual
TLS with a CA made here with openssl, and the refusal of a non-loopback address without TLS.

The tests run as root (the daemon's own uid, so an admin on the socket). Other uids need no
passwd entry: setpriv switches to the bare numbers below.
"""

import json
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from daemon import Daemon

RPC_TIMEOUT_S = 10
WATCH_TIMEOUT_S = 180
SOCKET_GID = 47901         # the socket's group
ALICE, BOB, CAROL = 47911, 47912, 47913  # admin with roots, unlisted (reader), admin without roots
STRANGER = 47914           # not in the socket's group
SPEC = {"recipe": "experts", "weight_format": "w4a16_nvfp4", "expert_cast": "lossless",
        "export_format": "modelopt"}


@pytest.fixture(scope="module", autouse=True)
def as_root():
    assert os.geteuid() == 0, "the access tests switch uids with setpriv: run them as root"


@pytest.fixture(scope="module")
def quantctl(qd):
    binary = Path(qd.binary).parents[1] / "client" / "quantctl"
    assert binary.is_file(), f"{binary} is missing: build quantctl first"
    return binary


@pytest.fixture(scope="module")
def public_dir():
    """public_dir() -> a new directory every uid can traverse (pytest's own are root's only);
    all are removed after the module."""
    made = []

    def make():
        made.append(Path(tempfile.mkdtemp(prefix="qd-access-")))
        made[-1].chmod(0o755)
        return made[-1]

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def private_file(path, text):
    path.write_text(text)
    path.chmod(0o600)
    return path


def code_and_details(call):
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def reason(error):
    return dict(error.trailing_metadata() or ()).get("quantd-reason")


def tiny_spec(pb, source, out):
    return pb.JobSpec(source=str(source["dir"]), output=str(out), **SPEC)


def test_unix_socket_is_0660_and_root_is_an_admin(qd, stubs, source, tmp_path):
    pb, pb_grpc = stubs
    with Daemon(qd.binary, tmp_path / "state", "--socket-group", SOCKET_GID) as d:
        st = os.stat(d.socket_path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_gid == SOCKET_GID
        assert d.info["listen"] == [f"unix:{os.path.abspath(d.socket_path)}"]
        assert d.tcp_address is None
        stub = pb_grpc.QuantServiceStub(d.channel())
        job = stub.SubmitJob(pb.SubmitJobRequest(spec=tiny_spec(pb, source, tmp_path / "out")),
                             timeout=RPC_TIMEOUT_S)
        last = list(stub.WatchJob(pb.WatchJobRequest(id=job.id), timeout=WATCH_TIMEOUT_S))[-1]
        assert last.state == pb.SUCCEEDED, last
        d.stop()
        assert not d.socket_path.exists()  # removed at a clean exit
        log = d.log()
    assert ("running as root: every admin's job reads and writes with root's rights; "
            "deploy/systemd/quantd.service runs quantd as its own user instead") in log


@pytest.fixture(scope="module")
def uid_daemon(qd, source, tmp_path_factory, public_dir):
    """A daemon whose access config gives ALICE admin rights inside the source and her own
    directory, CAROL admin rights without roots; BOB is not listed."""
    root = tmp_path_factory.mktemp("uids")
    alice_dir = public_dir()
    config = {"callers": [
        {"uid": ALICE, "role": "admin", "allowed_roots": [str(source["dir"]), str(alice_dir)]},
        {"uid": CAROL, "role": "admin"}]}
    (root / "access.json").write_text(json.dumps(config))
    d = Daemon(qd.binary, root / "state", "--access-config", root / "access.json",
               "--socket-group", SOCKET_GID, socket_path=public_dir() / "quantd.sock")
    d.start()
    yield {"daemon": d, "alice_dir": alice_dir, "root": root}
    try:
        d.stop()
    finally:
        d.close()


def run_as(uid, quantctl, daemon, *args, groups=(SOCKET_GID,)):
    """quantctl on the daemon's socket as `uid` (setpriv), in `groups` only."""
    group_args = ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    return subprocess.run(
        ["setpriv", "--reuid", str(uid), "--regid", str(uid), *group_args, str(quantctl),
         "--server", daemon.address, "--timeout", "10", *[str(a) for a in args]],
        capture_output=True, text=True, timeout=WATCH_TIMEOUT_S, cwd="/")


def test_second_uid_gets_its_role_from_its_uid(uid_daemon, quantctl, source):
    d = uid_daemon["daemon"]
    out = uid_daemon["alice_dir"] / "bob-out"
    # Not in the socket's group: the kernel refuses the connection.
    proc = run_as(STRANGER, quantctl, d, "list", groups=())
    assert proc.returncode == 5, proc.stderr
    assert "Permission denied" in proc.stderr
    # Unlisted: a reader.
    proc = run_as(BOB, quantctl, d, "list")
    assert proc.returncode == 0, proc.stderr
    proc = run_as(BOB, quantctl, d, "submit", "--source", source["dir"], "--output", out,
                  "--weight-format", "w4a16_nvfp4")
    assert proc.returncode == 7, proc.stderr
    assert proc.stderr == (f"quantctl: PERMISSION_DENIED: SubmitJob needs the admin role; "
                           f"uid {BOB} is a reader\n")
    proc = run_as(BOB, quantctl, d, "cancel", 1)
    assert proc.returncode == 7, proc.stderr
    assert proc.stderr == (f"quantctl: PERMISSION_DENIED: CancelJob needs the admin role; "
                           f"uid {BOB} is a reader\n")
    # An admin without allowed_roots may name no path.
    proc = run_as(CAROL, quantctl, d, "submit", "--source", source["dir"], "--output", out,
                  "--weight-format", "w4a16_nvfp4")
    assert proc.returncode == 7, proc.stderr
    assert proc.stderr == (f"quantctl: PERMISSION_DENIED: spec.source: uid {CAROL} has no "
                           "allowed_roots in the access config, so it may name no path\n")


def test_allowed_roots_are_enforced_after_resolution(uid_daemon, quantctl, source, stubs,
                                                     tmp_path):
    pb, pb_grpc = stubs
    d = uid_daemon["daemon"]
    alice_dir = uid_daemon["alice_dir"]
    roots = f"({source['dir']}, {alice_dir})"
    # Inside her roots: the job runs.
    proc = run_as(ALICE, quantctl, d, "submit", "--source", source["dir"], "--output",
                  alice_dir / "out", "--weight-format", "w4a16_nvfp4", "--watch")
    assert proc.returncode == 0, proc.stderr
    # Outside, through "..", and through a symlink inside her directory: refused, field named.
    outside = tmp_path / "outside"
    (alice_dir / "link").symlink_to(tmp_path)
    for output, resolved in ((outside, outside),
                             (alice_dir / ".." / "elsewhere", alice_dir.parent / "elsewhere"),
                             (alice_dir / "link" / "out", tmp_path / "out")):
        proc = run_as(ALICE, quantctl, d, "submit", "--source", source["dir"], "--output", output,
                      "--weight-format", "w4a16_nvfp4")
        assert proc.returncode == 7, proc.stderr
        assert proc.stderr == (f"quantctl: PERMISSION_DENIED: spec.output: {resolved} is outside "
                               f"the allowed roots of uid {ALICE} {roots}\n")
    assert not outside.exists()
    # The calibration's files too: the data sets it reads and the amax table it writes.
    for flag, value, field in (("--calibration-dataset", outside / "news.jsonl:8",
                                "calibration.datasets[0].path"),
                               ("--amax-out", outside / "amax.json", "calibration.amax_out")):
        proc = run_as(ALICE, quantctl, d, "submit", "--source", source["dir"], "--output",
                      alice_dir / "cal-out", "--weight-format", "w4a16_nvfp4", flag, value)
        assert proc.returncode == 7, proc.stderr
        resolved = str(value).rsplit(":", 1)[0]
        assert proc.stderr == (f"quantctl: PERMISSION_DENIED: spec.{field}: {resolved} is outside "
                               f"the allowed roots of uid {ALICE} {roots}\n")
    assert not outside.exists()
    # A job of root's outside her roots: she may read it, not change it.
    stub = pb_grpc.QuantServiceStub(d.channel())
    job = stub.SubmitJob(pb.SubmitJobRequest(spec=tiny_spec(pb, source, tmp_path / "root-out")),
                         timeout=RPC_TIMEOUT_S)
    list(stub.WatchJob(pb.WatchJobRequest(id=job.id), timeout=WATCH_TIMEOUT_S))
    assert run_as(ALICE, quantctl, d, "get", job.id).returncode == 0
    proc = run_as(ALICE, quantctl, d, "delete", job.id)
    assert proc.returncode == 7, proc.stderr
    assert proc.stderr == (f"quantctl: PERMISSION_DENIED: DeleteJob of job {job.id}: spec.output: "
                           f"{tmp_path / 'root-out'} is outside the allowed roots of uid {ALICE} "
                           f"{roots}\n")
    stub.DeleteJob(pb.DeleteJobRequest(id=job.id), timeout=RPC_TIMEOUT_S)


@pytest.fixture(scope="module")
def token_daemon(qd, tmp_path_factory):
    """Loopback TCP with an admin token (--token-file) and a reader token (access config)."""
    root = tmp_path_factory.mktemp("tokens")
    admin = private_file(root / "admin.token", "admin-token-0123456789abcdef\n")
    reader = private_file(root / "reader.token", "reader-token-0123456789abcdef")
    (root / "access.json").write_text(json.dumps(
        {"callers": [{"token_file": str(reader), "role": "reader"}]}))
    d = Daemon(qd.binary, root / "state", "--listen", "127.0.0.1:0", "--token-file", admin,
               "--access-config", root / "access.json")
    d.start()
    yield {"daemon": d, "admin": admin, "reader": reader}
    try:
        d.stop()
    finally:
        d.close()


def bearer(path):
    return (("authorization", "Bearer " + path.read_text().strip()),)


def test_tcp_callers_need_a_known_token(token_daemon, stubs, source, tmp_path):
    pb, pb_grpc = stubs
    d = token_daemon["daemon"]
    channel = grpc.insecure_channel(d.tcp_address)
    d.channels.append(channel)
    stub = pb_grpc.QuantServiceStub(channel)
    list_jobs = stub.ListJobs
    request = pb.ListJobsRequest()
    for metadata, details in (
            ((), "no credentials: connect over quantd's unix socket, or send a bearer token "
                 "(quantctl --token-file) or a client certificate (quantctl --tls-cert/--tls-key)"),
            ((("authorization", "Bearer not-a-token-quantd-knows"),),
             "the bearer token is not one quantd knows"),
            ((("authorization", "Basic YWRtaW46YWRtaW4="),),
             "authorization metadata: expected \"Bearer <token>\"")):
        with pytest.raises(grpc.RpcError) as info:
            list_jobs(request, metadata=metadata, timeout=RPC_TIMEOUT_S)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert info.value.details() == details
        assert reason(info.value) == "NOT_AUTHENTICATED"
        with pytest.raises(grpc.RpcError) as info:  # streams too
            list(stub.WatchJob(pb.WatchJobRequest(id=1), metadata=metadata,
                               timeout=RPC_TIMEOUT_S))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

    # The reader reads, and may change nothing.
    reader = bearer(token_daemon["reader"])
    assert list_jobs(request, metadata=reader, timeout=RPC_TIMEOUT_S) is not None
    who = f"the token of {token_daemon['reader']}"
    spec = tiny_spec(pb, source, tmp_path / "out")
    for method, message, name in (
            (stub.SubmitJob, pb.SubmitJobRequest(spec=spec), "SubmitJob"),
            (stub.CancelJob, pb.CancelJobRequest(id=1), "CancelJob"),
            (stub.ResumeJob, pb.ResumeJobRequest(id=1), "ResumeJob"),
            (stub.DeleteJob, pb.DeleteJobRequest(id=1), "DeleteJob")):
        with pytest.raises(grpc.RpcError) as info:
            method(message, metadata=reader, timeout=RPC_TIMEOUT_S)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert info.value.details() == f"{name} needs the admin role; {who} is a reader"
        assert reason(info.value) == "ADMIN_ONLY"

    # The admin token submits; the reader follows the job to its end.
    admin = bearer(token_daemon["admin"])
    job = stub.SubmitJob(pb.SubmitJobRequest(spec=spec), metadata=admin, timeout=RPC_TIMEOUT_S)
    last = list(stub.WatchJob(pb.WatchJobRequest(id=job.id), metadata=reader,
                              timeout=WATCH_TIMEOUT_S))[-1]
    assert last.state == pb.SUCCEEDED, last
    report = stub.GetJobReport(pb.GetJobReportRequest(id=job.id), metadata=reader,
                               timeout=RPC_TIMEOUT_S)
    assert report.job_id == job.id and report.tensors_total > 0

    # Health checking needs no credentials.
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="quantd.v1.QuantService"),
                        timeout=RPC_TIMEOUT_S).status == health_pb2.HealthCheckResponse.SERVING


def test_quantctl_token_file_on_tcp(token_daemon, quantctl):
    d = token_daemon["daemon"]
    base = [str(quantctl), "--server", d.tcp_address, "--timeout", "10"]
    proc = subprocess.run([*base, "--token-file", token_daemon["reader"], "list"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([*base, "list"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7, proc.stderr
    assert proc.stderr.startswith("quantctl: UNAUTHENTICATED: no credentials")


def openssl(*args, cwd):
    subprocess.run(["openssl", *map(str, args)], cwd=cwd, check=True, capture_output=True)


def make_cert(cwd, name, ca, subject, extensions):
    """name.key and name.pem signed by ca (.key/.pem), with the given X.509v3 extensions."""
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=cwd)
    (cwd / f"{name}.ext").write_text(extensions + "\n")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext",
            cwd=cwd)


def make_ca(cwd, name, subject=None):
    """A self-signed name.key and name.pem (subject /CN=name unless given)."""
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj",
            subject or f"/CN={name}", cwd=cwd)


@pytest.fixture(scope="module")
def tls_daemon(qd, tmp_path_factory):
    """Loopback TCP with mutual TLS: a CA, the daemon's certificate for 127.0.0.1, client
    certificates CN=trainer (an admin in the access config) and CN=viewer (unlisted: a reader),
    and certificates for CN=trainer that the CA did not sign: from another CA, from another CA
    that copies the real CA's name, self-signed, and signed with the viewer's own key."""
    pki = tmp_path_factory.mktemp("pki")
    make_ca(pki, "ca")
    make_ca(pki, "rogue-ca")
    make_cert(pki, "server", "ca", "/CN=quantd", "subjectAltName=IP:127.0.0.1,DNS:localhost")
    client_ext = "extendedKeyUsage=clientAuth"
    make_cert(pki, "trainer", "ca", "/CN=trainer", client_ext)
    make_cert(pki, "viewer", "ca", "/CN=viewer", client_ext)
    make_cert(pki, "rogue", "rogue-ca", "/CN=trainer", client_ext)
    (pki / "lookalike").mkdir()
    make_ca(pki / "lookalike", "ca")  # subject /CN=ca, like the real CA, another key
    make_cert(pki / "lookalike", "trainer", "ca", "/CN=trainer", client_ext)
    make_ca(pki, "self", "/CN=trainer")
    make_cert(pki, "minted", "viewer", "/CN=trainer", client_ext)
    (pki / "access.json").write_text(json.dumps({"callers": [
        {"tls_common_name": "trainer", "role": "admin", "allowed_roots": [str(pki)]}]}))
    d = Daemon(qd.binary, pki / "state", "--listen", "127.0.0.1:0", "--tls-cert",
               pki / "server.pem", "--tls-key", pki / "server.key", "--tls-client-ca",
               pki / "ca.pem", "--access-config", pki / "access.json")
    d.start()
    yield {"daemon": d, "pki": pki}
    try:
        d.stop()
    finally:
        d.close()


def tls_stub(stubs, d, pki, client, chain=()):
    """A stub whose channel presents client.pem (followed by the `chain` certificates), or no
    client certificate when `client` is None."""
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / f"{client}.key").read_bytes() if client else None,
        certificate_chain=b"".join((pki / f"{c}.pem").read_bytes() for c in (client, *chain))
        if client else None)
    channel = grpc.secure_channel(d.tcp_address, credentials)
    d.channels.append(channel)
    return stubs[1].QuantServiceStub(channel)


def test_mutual_tls_identifies_the_client_certificate(tls_daemon, stubs, source):
    pb = stubs[0]
    d, pki = tls_daemon["daemon"], tls_daemon["pki"]
    request = pb.ListJobsRequest()
    assert tls_stub(stubs, d, pki, "trainer").ListJobs(request, timeout=RPC_TIMEOUT_S) is not None
    # CN=viewer is not listed: a reader.
    spec = tiny_spec(pb, source, pki / "out")
    code, details = code_and_details(lambda: tls_stub(stubs, d, pki, "viewer").SubmitJob(
        pb.SubmitJobRequest(spec=spec), timeout=RPC_TIMEOUT_S))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert details == "SubmitJob needs the admin role; client certificate CN=viewer is a reader"
    # CN=trainer is an admin inside its roots (the source is not).
    code, details = code_and_details(lambda: tls_stub(stubs, d, pki, "trainer").SubmitJob(
        pb.SubmitJobRequest(spec=spec), timeout=RPC_TIMEOUT_S))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert details == (f"spec.source: {source['dir']} is outside the allowed roots of client "
                       f"certificate CN=trainer ({pki})")
    # No client certificate, one from another CA, or no TLS at all: no connection.
    for stub in (tls_stub(stubs, d, pki, None), tls_stub(stubs, d, pki, "rogue")):
        code, _ = code_and_details(lambda: stub.ListJobs(request, timeout=RPC_TIMEOUT_S))
        assert code == grpc.StatusCode.UNAVAILABLE
    plain = grpc.insecure_channel(d.tcp_address)
    d.channels.append(plain)
    code, _ = code_and_details(
        lambda: stubs[1].QuantServiceStub(plain).ListJobs(request, timeout=RPC_TIMEOUT_S))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_every_certificate_its_ca_did_not_sign(tls_daemon, stubs):
    """Issue 19 item 6: client certificates naming the admin (CN=trainer) that the daemon's CA did
    not sign get no connection, however they are presented; the daemon serves on."""
    pb = stubs[0]
    d, pki = tls_daemon["daemon"], tls_daemon["pki"]
    request = pb.ListJobsRequest()
    for client, chain in (("rogue", ()),                 # another CA
                          ("rogue", ("rogue-ca",)),      # ... with that CA in the chain
                          ("lookalike/trainer", ()),     # a CA with the real CA's name
                          ("lookalike/trainer", ("lookalike/ca",)),
                          ("self", ()),                  # self-signed
                          ("minted", ("viewer",))):      # the reader's leaf used as a CA
        code, details = code_and_details(
            lambda: tls_stub(stubs, d, pki, client, chain).ListJobs(request,
                                                                   timeout=RPC_TIMEOUT_S))
        assert code == grpc.StatusCode.UNAVAILABLE, (client, chain, details)
    assert tls_stub(stubs, d, pki, "trainer").ListJobs(request, timeout=RPC_TIMEOUT_S) is not None


def test_quantctl_tls_flags(tls_daemon, quantctl):
    d, pki = tls_daemon["daemon"], tls_daemon["pki"]
    base = [str(quantctl), "--server", d.tcp_address, "--timeout", "10", "--tls-ca",
            pki / "ca.pem"]
    proc = subprocess.run([*base, "--tls-cert", pki / "viewer.pem", "--tls-key",
                           pki / "viewer.key", "list"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([*base, "list"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 5, proc.stderr  # the daemon wants a client certificate


def serve_refused(qd, tmp_path, *args):
    proc = qd.run("serve", "--state-dir", tmp_path / "state", "--metrics-listen", "none",
                  "--devices", "cpu", *args, timeout=60)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert not (tmp_path / "state").exists()  # refused before touching the state dir
    return proc.stderr.splitlines()[-1] + "\n"  # after the warning about running as root


def test_tcp_without_tls_or_credentials_is_refused(qd, tmp_path):
    token = private_file(tmp_path / "admin.token", "admin-token-0123456789abcdef")
    assert serve_refused(qd, tmp_path, "--listen", "0.0.0.0:0", "--token-file", token) == (
        "quantd serve: listen (--listen) 0.0.0.0:0: not a loopback address, and without TLS its "
        "tokens and jobs cross the network in clear text; give --tls-cert/--tls-key (or "
        "--insecure to accept that)\n")
    assert serve_refused(qd, tmp_path, "--listen", "127.0.0.1:0") == (
        "quantd serve: listen (--listen) 127.0.0.1:0: no TCP caller could authenticate; give "
        "--token-file, token_file entries in --access-config, or --tls-client-ca\n")
    token.chmod(0o644)
    assert serve_refused(qd, tmp_path, "--listen", "127.0.0.1:0", "--token-file", token) == (
        f"quantd serve: token file {token}: readable by group or others (mode 0644); "
        "chmod 600 it\n")


def test_insecure_allows_a_non_loopback_address_with_a_warning(qd, stubs, tmp_path):
    token = private_file(tmp_path / "admin.token", "admin-token-0123456789abcdef")
    with Daemon(qd.binary, tmp_path / "state", "--listen", "0.0.0.0:0", "--token-file", token,
                "--insecure") as d:
        port = d.tcp_address.rsplit(":", 1)[1]
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        d.channels.append(channel)
        pb, pb_grpc = stubs
        assert pb_grpc.QuantServiceStub(channel).ListJobs(
            pb.ListJobsRequest(), metadata=bearer(token), timeout=RPC_TIMEOUT_S) is not None
        d.stop()
        assert ("--insecure: serving 0.0.0.0:0 without TLS; tokens and job data cross the "
                "network in clear text") in d.log()


def test_listen_none_overrides_a_config_files_addresses(qd, tmp_path):
    """The harness passes --listen none: a config file's TCP addresses (here one that would be
    refused) give way to the socket alone."""
    config = tmp_path / "serve.json"
    config.write_text(json.dumps({"listen": ["0.0.0.0:50051"]}))
    with Daemon(qd.binary, tmp_path / "state", "--config", config) as d:
        assert d.info["listen"] == [f"unix:{os.path.abspath(d.socket_path)}"]
        d.stop()
