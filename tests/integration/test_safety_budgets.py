"""Issue 19 item 3 against the real daemon: the tokenizer and data set budgets. A tokenizer.json
whose normalizer doubles "a" 40 times aborted the daemon (std::bad_alloc on the planning thread);
a pre-tokenizer pattern costing 2^18 steps a character kept the planning thread busy; a data set
listed 8 times took 2.5 GiB. Each now fails its job with an error naming the file and the field,
the daemon keeps answering and plans the next job, and SIGTERM stops it promptly. And the rule
made right: input_ids data calibrates a checkpoint that has no tokenizer.json, on ids the model's
embedding has (the fixture's byte-level tokenizer stops at id 260, the model has 1024 rows).
"""

import json
import time

from daemon import Daemon
from job_client import JobClient as Client

BOMB = {"type": "Sequence", "normalizers": [
    {"type": "Replace", "pattern": {"String": "a"}, "content": "aa"}] * 40}
# 18 two-way choices, then six digits that never come: 2^18 steps at every start position, under
# PCRE2's match limit at each.
WEDGE = {"type": "Split", "pattern": {"Regex": "(?:.|.){18}\\d\\d\\d\\d\\d\\d"},
         "behavior": "Isolated", "invert": False}


def edit_tokenizer(model, edit):
    path = model / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    edit(tokenizer)
    path.write_text(json.dumps(tokenizer))


def prose(path, lines=8, words=400):
    """A text data set: `lines` samples of `words` words each."""
    text = " ".join(f"word{i % 97} and another" for i in range(words))
    path.write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(lines)))
    return path


def calibrating(client, model, out, **calibration):
    pb = client.pb
    spec = pb.JobSpec(source=str(model), output=str(out), recipe="experts", weight_format="nvfp4",
                      calibration=pb.CalibrationSpec(**{"seq_len": 256, "min_seq_len": 16,
                                                        **calibration}),
                      evaluate=pb.EvaluateSpec(enabled=False))
    return client.stub.SubmitJob(pb.SubmitJobRequest(spec=spec), timeout=10)


def the_next_job_succeeds(client, source, out):
    job = client.finish(client.submit(source=str(source["dir"]), output=str(out)).id)
    assert job.state == client.pb.SUCCEEDED, job


def test_normalizer_bomb_fails_the_job_not_the_daemon(qd, stubs, source, model, tmp_path):
    edit_tokenizer(model, lambda t: t.update(normalizer=BOMB))
    data = prose(tmp_path / "data.jsonl")
    with Daemon(qd.binary, tmp_path / "state") as d:
        client = Client(stubs, d.channel())
        start = time.monotonic()
        job = client.finish(calibrating(client, model, tmp_path / "out",
                                        dataset=str(data), num_samples=4).id)
        assert job.state == client.pb.FAILED, job
        assert time.monotonic() - start < 30
        assert f"{model}/tokenizer.json: field 'normalizer.normalizers[" in job.last_error, job
        assert "(the normalizer may grow a text 4 times)" in job.last_error, job
        client.responsive(job.id)
        the_next_job_succeeds(client, source, tmp_path / "next")
        assert d.stop() < 10
        assert "bad_alloc" not in d.log()


def test_catastrophic_pre_tokenizer_pattern_fails_the_job_in_seconds(qd, stubs, source, model,
                                                                      tmp_path):
    edit_tokenizer(model, lambda t: t["pre_tokenizer"]["pretokenizers"].insert(0, WEDGE))
    # 8 samples of 9 KB: an hour of matching each without the budget (6 ms a character).
    data = prose(tmp_path / "data.jsonl")
    with Daemon(qd.binary, tmp_path / "state") as d:
        client = Client(stubs, d.channel())
        start = time.monotonic()
        job = client.finish(calibrating(client, model, tmp_path / "out",
                                        dataset=str(data), num_samples=4).id)
        assert job.state == client.pb.FAILED, job
        assert time.monotonic() - start < 30
        assert (f"{model}/tokenizer.json: field 'pre_tokenizer.pretokenizers[0].pattern.Regex' "
                "spent the text's budget of ") in job.last_error, job
        assert f"{data}:" in job.last_error, job
        client.responsive(job.id)
        the_next_job_succeeds(client, source, tmp_path / "next")
        assert d.stop() < 10


def test_a_data_set_listed_8_times_is_refused(qd, stubs, source, tmp_path):
    data = prose(tmp_path / "data.jsonl")
    with Daemon(qd.binary, tmp_path / "state") as d:
        client = Client(stubs, d.channel())
        datasets = [client.pb.CalibrationDataset(path=str(data), samples=1)] * 8
        job = client.finish(calibrating(client, source["dir"], tmp_path / "out",
                                        datasets=datasets).id)
        assert job.state == client.pb.FAILED, job
        assert ("calibration.datasets[1].path names the file of calibration.datasets[0].path "
                "again") in job.last_error, job
        # The same file by another path (a hard link; the daemon resolves symlinks at submit).
        (tmp_path / "alias.jsonl").hardlink_to(data)
        datasets = [client.pb.CalibrationDataset(path=str(p), samples=1)
                    for p in (data, tmp_path / "alias.jsonl")]
        job = client.finish(calibrating(client, source["dir"], tmp_path / "out2",
                                        datasets=datasets).id)
        assert job.state == client.pb.FAILED, job
        assert ("calibration.datasets[1].path is the file of calibration.datasets[0].path by "
                "another path") in job.last_error, job
        the_next_job_succeeds(client, source, tmp_path / "next")
        d.stop()


def test_input_ids_calibrate_a_checkpoint_without_a_tokenizer(qd, stubs, model, tmp_path):
    (model / "tokenizer.json").unlink()
    (model / "tokenizer_config.json").unlink()
    data = tmp_path / "ids.jsonl"
    # Ids up to 1023: the model's rows; the fixture's tokenizer has tokens to 260 only.
    data.write_text("".join(json.dumps({"input_ids": [(7 * i + 97 * k) % 1024 for i in range(40)]})
                            + "\n" for k in range(8)))
    with Daemon(qd.binary, tmp_path / "state") as d:
        client = Client(stubs, d.channel())
        job = client.finish(calibrating(client, model, tmp_path / "out", dataset=str(data),
                                        num_samples=4).id)
        assert job.state == client.pb.SUCCEEDED, job.last_error
        # An id past the embedding is refused, naming the file and line.
        data.write_text(json.dumps({"input_ids": [5, 1024]}) + "\n")
        job = client.finish(calibrating(client, model, tmp_path / "out2", dataset=str(data),
                                        num_samples=1, min_seq_len=1).id)
        assert job.state == client.pb.FAILED, job
        assert (f"{data}:1: input_ids[1] is not a token id of the model (0 to 1023)"
                in job.last_error), job
        d.stop()


def test_a_5_mb_component_name_is_quoted_as_a_short_excerpt(qd, stubs, model, tmp_path):
    edit_tokenizer(model, lambda t: t.update(normalizer={"type": "N" * 5_000_000}))
    data = prose(tmp_path / "data.jsonl")
    with Daemon(qd.binary, tmp_path / "state") as d:
        client = Client(stubs, d.channel())
        job = client.finish(calibrating(client, model, tmp_path / "out",
                                        dataset=str(data), num_samples=4).id)
        assert job.state == client.pb.FAILED, job
        assert (f"{model}/tokenizer.json: field 'normalizer.type' has unsupported type \""
                + "N" * 64 + "...\" (quantd reads Sequence, Prepend and Replace with a String "
                "pattern)") in job.last_error, job.last_error[:300]
        assert len(job.last_error) < 1024, len(job.last_error)
        d.stop()
