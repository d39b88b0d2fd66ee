#!/usr/bin/env python3
"""Writes the seed corpus of grpc_request_fuzz into tests/fuzz/corpus-grpc-requests/: one file per
seed, the method byte (grpc_request_fuzz.cc's kUnary order, WatchJob last) then the serialized
request. Needs grpcio-tools (the test virtualenv); the files are committed, so this only needs
rerunning when seeds change.

  ~/.cache/quantd/venv/bin/python tests/fuzz/gen_grpc_corpus.py
"""
import pathlib
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests" / "integration"))
from daemon import grpc_stubs  # noqa: E402

METHODS = ["SubmitJob", "GetJob", "ListJobs", "CancelJob", "ResumeJob", "DeleteJob",
           "GetJobReport", "WatchJob"]


def main():
    pb, _ = grpc_stubs(tempfile.mkdtemp(prefix="quantd-stubs-"))
    spec = pb.JobSpec(source="/models/src", output="/models/out", recipe="experts",
                      weight_format="w4a16_nvfp4", expert_cast="lossless",
                      export_format="modelopt")
    full = pb.JobSpec(source="src", output="out", include=["layers.*.ffn.experts.*"],
                      exclude=["layers.0.*"], weight_format="nvfp4", kv_cache="fp8",
                      materialize_bf16="bf16", devices=["cpu"], host_memory_bytes=1 << 30,
                      calibration=pb.CalibrationSpec(amax_file="amax.json", num_samples=8))
    calibrated = pb.JobSpec(source="/models/src", output="/models/out",
                            calibration=pb.CalibrationSpec(
                                datasets=[pb.CalibrationDataset(path="/cal/a.jsonl", samples=4),
                                          pb.CalibrationDataset(path="/cal/b.jsonl")],
                                num_samples=8, seq_len=64, min_seq_len=0, seed=3, add_bos=False,
                                mode="data", w2_input="weighted", expert_amax="layer_max",
                                uncalibrated="model_max", numerics="math",
                                amax_out="/cal/amax.json"))
    seeds = {
        "submit_experts": ("SubmitJob", pb.SubmitJobRequest(request_id="r1", spec=spec)),
        "submit_custom": ("SubmitJob", pb.SubmitJobRequest(spec=full)),
        "submit_empty": ("SubmitJob", pb.SubmitJobRequest()),
        "submit_calibration": ("SubmitJob", pb.SubmitJobRequest(spec=calibrated)),
        "get_1": ("GetJob", pb.GetJobRequest(id=1)),
        "get_negative": ("GetJob", pb.GetJobRequest(id=-5)),
        "list_running": ("ListJobs", pb.ListJobsRequest(state=pb.RUNNING, page_size=10)),
        "list_token": ("ListJobs", pb.ListJobsRequest(page_token="Mg", page_size=1000)),
        "cancel_pause": ("CancelJob", pb.CancelJobRequest(id=1, pause=True)),
        "cancel": ("CancelJob", pb.CancelJobRequest(id=2)),
        "resume": ("ResumeJob", pb.ResumeJobRequest(id=1)),
        "delete": ("DeleteJob", pb.DeleteJobRequest(id=1)),
        "report": ("GetJobReport", pb.GetJobReportRequest(id=1, worst=3)),
        "watch": ("WatchJob", pb.WatchJobRequest(id=1)),
    }
    out = HERE / "corpus-grpc-requests"
    out.mkdir(exist_ok=True)
    for name, (method, request) in seeds.items():
        (out / name).write_bytes(bytes([METHODS.index(method)]) + request.SerializeToString())


if __name__ == "__main__":
    main()
