#!/usr/bin/env bash
# The worker pool's --container_executable (infra/flink-cluster.sh): each SDK harness started with the job's
# pipeline options (ember/dev/flink_boot.py). `python` is the venv's: the pool puts its bin/ first on PATH.
exec python -m ember.dev.flink_boot "$@"
