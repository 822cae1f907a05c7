"""The SDK harness boot of the Flink session cluster's worker pool (infra/flink-cluster.sh), as Beam's container boot.

Beam's worker pool in process mode starts each harness as a bare `SdkHarness(control_url).run()`, which never learns
the job's pipeline options: Beam's FileSystems then run without them, and its S3 filesystem refuses every call
("Must provide one of client or options"), so an s3:// input or output fails on the cluster. With this boot as the
pool's `--container_executable`, each harness is started the way Beam's SDK container starts one: the job's options
fetched from the runner's provision service, then `sdk_worker_main`, which hands them to FileSystems (and logs to the
runner).

    python -m ember.dev.flink_boot --id=ID --provision_endpoint=HOST:PORT --control_endpoint=HOST:PORT
        [--logging_endpoint=HOST:PORT] [--artifact_endpoint=HOST:PORT]
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> None:
    import grpc
    from apache_beam.portability.api import beam_provision_api_pb2, beam_provision_api_pb2_grpc, endpoints_pb2
    from google.protobuf import json_format, text_format

    parser = argparse.ArgumentParser(description="start a Beam SDK harness with the job's pipeline options")
    for name in ("id", "provision_endpoint", "control_endpoint"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--logging_endpoint")
    parser.add_argument("--artifact_endpoint")  # the code is on the pool's PYTHONPATH: nothing to retrieve
    args = parser.parse_args(argv)

    with grpc.insecure_channel(args.provision_endpoint) as channel:
        info = beam_provision_api_pb2_grpc.ProvisionServiceStub(channel).GetProvisionInfo(
            beam_provision_api_pb2.GetProvisionInfoRequest(), metadata=[("worker_id", args.id)]).info

    def descriptor(url: str) -> str:
        return text_format.MessageToString(endpoints_pb2.ApiServiceDescriptor(url=url))

    env = {**os.environ, "WORKER_ID": args.id, "PIPELINE_OPTIONS": json_format.MessageToJson(info.pipeline_options),
           "CONTROL_API_SERVICE_DESCRIPTOR": descriptor(args.control_endpoint)}
    if args.logging_endpoint:
        env["LOGGING_API_SERVICE_DESCRIPTOR"] = descriptor(args.logging_endpoint)
    os.execve(sys.executable, [sys.executable, "-m", "apache_beam.runners.worker.sdk_worker_main"], env)


if __name__ == "__main__":
    main()
