#!/usr/bin/env python3
"""Container healthcheck: asks quantd's gRPC health service (grpc.health.v1) whether
quantd.v1.QuantService is SERVING. Exit 0 when it is, 1 otherwise (not serving, not answering
within the timeout, not reachable).

  quantd-healthcheck [ADDRESS]     ADDRESS: host:port or unix:/path (default 127.0.0.1:50051)

The health messages are built by hand (two tiny protos) so that only python3-grpcio is needed.
"""
import sys

import grpc

SERVICE = "quantd.v1.QuantService"
TIMEOUT_S = 5
SERVING = 1  # grpc.health.v1.HealthCheckResponse.ServingStatus.SERVING


def encode_request(service):
    """HealthCheckRequest{service}: field 1, length-delimited."""
    data = service.encode()
    assert len(data) < 128
    return b"\x0a" + bytes([len(data)]) + data


def decode_status(data):
    """HealthCheckResponse.status: field 1, varint (0 when absent, UNKNOWN)."""
    if len(data) >= 2 and data[0] == 0x08:
        return data[1]
    return 0


def main(argv):
    address = argv[1] if len(argv) > 1 else "127.0.0.1:50051"
    with grpc.insecure_channel(address) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                    request_serializer=None, response_deserializer=None)
        try:
            reply = check(encode_request(SERVICE), timeout=TIMEOUT_S)
        except grpc.RpcError as e:
            print(f"quantd-healthcheck: {address}: {e.code().name}", file=sys.stderr)
            return 1
    status = decode_status(reply)
    if status != SERVING:
        print(f"quantd-healthcheck: {address}: {SERVICE} status {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
