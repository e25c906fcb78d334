#!/usr/bin/env bash
# A local stack on 127.0.0.1: Prefect server, MLflow server (SQLite + proxied
# artifacts on S3), and an S3 server (moto). Ctrl-C stops all three.
#   infra/local-stack.sh [STATE_DIR]
# Then, in another shell:
#   export PREFECT_API_URL=http://127.0.0.1:4200/api AWS_ENDPOINT_URL=http://127.0.0.1:9000 \
#          AWS_ACCESS_KEY_ID=local AWS_SECRET_ACCESS_KEY=local AWS_DEFAULT_REGION=us-east-1
#   ladle run recipes/tiny-cpu.yaml --set output=s3://ladle/runs --set tracking.uri=http://127.0.0.1:5000
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BIN="$ROOT/.venv/bin"
STATE="${1:-$ROOT/runs/stack}"
mkdir -p "$STATE"
export PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_HOME="$STATE/prefect"
export AWS_ACCESS_KEY_ID=local AWS_SECRET_ACCESS_KEY=local AWS_DEFAULT_REGION=us-east-1
trap 'kill 0' EXIT
"$BIN/moto_server" -H 127.0.0.1 -p 9000 &
sleep 2
AWS_ENDPOINT_URL=http://127.0.0.1:9000 "$BIN/python" -c "import boto3; boto3.client('s3').create_bucket(Bucket='ladle')"
MLFLOW_S3_ENDPOINT_URL=http://127.0.0.1:9000 "$BIN/mlflow" server --host 127.0.0.1 --port 5000 \
  --backend-store-uri "sqlite:///$STATE/mlflow.db" --artifacts-destination s3://ladle/mlflow &
"$BIN/prefect" server start --host 127.0.0.1 --port 4200 &
wait
