#!/usr/bin/env bash
# Regenerates hfsampler/export/exposition_pb/metrics_pb2.py from proto/ (Prometheus's protobuf
# exposition format, io.prometheus.client). The module is the reference the tests hold /metrics'
# hand-written bytes to; hfsampler itself never imports it.
# Usage: scripts/gen_exposition_proto.sh [OUT_ROOT]   (OUT_ROOT defaults to the repository root;
# the staleness test passes a temporary directory and compares with the committed module.)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root}"
python="${PYTHON:-python}"
mkdir -p "$out/hfsampler/export/exposition_pb"
"$python" -m grpc_tools.protoc \
  --proto_path="$root/proto" \
  --python_out="$out" \
  "$root/proto/hfsampler/export/exposition_pb/metrics.proto"
