"""JobClient: the QuantService calls that the safety tests (test_safety_*.py) make on a channel of
daemon.Daemon, with the spec defaults they share."""

from grpc_health.v1 import health_pb2, health_pb2_grpc

RPC_TIMEOUT_S = 10
WATCH_TIMEOUT_S = 180
# Spec fields of every submit unless the test gives them: the quickest real conversion.
DEFAULT_SPEC = {"recipe": "experts", "weight_format": "w4a16_nvfp4"}


class JobClient:
    def __init__(self, stubs, channel):
        self.pb, pb_grpc = stubs
        self.stub = pb_grpc.QuantServiceStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    def submit(self, request_id="", **fields):
        """SubmitJob of DEFAULT_SPEC updated with `fields` (JobSpec fields; `calibration` a
        CalibrationSpec or a dict of its fields)."""
        fields = {**DEFAULT_SPEC, **fields}
        calibration = fields.pop("calibration", None)
        spec = self.pb.JobSpec(**fields)
        if isinstance(calibration, dict):
            calibration = self.pb.CalibrationSpec(**calibration)
        if calibration is not None:
            spec.calibration.CopyFrom(calibration)
        return self.stub.SubmitJob(self.pb.SubmitJobRequest(request_id=request_id, spec=spec),
                                   timeout=RPC_TIMEOUT_S)

    def finish(self, job_id):
        """The job's last snapshot once it is SUCCEEDED, FAILED, CANCELLED or PAUSED."""
        last = None
        for last in self.stub.WatchJob(self.pb.WatchJobRequest(id=job_id),
                                       timeout=WATCH_TIMEOUT_S):
            pass
        return last

    def responsive(self, job_id):
        """GetJob, ListJobs and health each answer within a second."""
        for call in (lambda: self.stub.GetJob(self.pb.GetJobRequest(id=job_id), timeout=1),
                     lambda: self.stub.ListJobs(self.pb.ListJobsRequest(), timeout=1),
                     lambda: self.health.Check(health_pb2.HealthCheckRequest(service=""),
                                               timeout=1)):
            call()
