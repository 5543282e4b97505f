#!/usr/bin/env bash
# Regenerates hfsampler/export/attribution_pb/podresources_pb2.py from proto/ (the kubelet's pod-resources
# API). Usage: scripts/gen_attribution_proto.sh [OUT_ROOT]   (OUT_ROOT defaults to the repository
# root; the staleness test passes a temporary directory and compares with the committed module.)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root}"
python="${PYTHON:-python}"
mkdir -p "$out/hfsampler/export/attribution_pb"
# Only the messages are generated: the client and the tests' fake kubelet name the one gRPC method
# themselves, so no *_pb2_grpc module (and its untyped code) is needed.
"$python" -m grpc_tools.protoc \
  --proto_path="$root/proto" \
  --python_out="$out" \
  "$root/proto/hfsampler/export/attribution_pb/podresources.proto"
