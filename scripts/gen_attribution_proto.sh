#!/usr/bin/env bash
# Regenerates the attribution protocols' modules from proto/: the kubelet's pod-resources API
# (hfsampler/export/attribution_pb/podresources_pb2.py) and the container runtime's CRI
# (hfsampler/consumers/cri_pb/cri_pb2.py). Usage: scripts/gen_attribution_proto.sh [OUT_ROOT]
# (OUT_ROOT defaults to the repository root; the staleness tests pass a temporary directory and
# compare with the committed modules.)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root}"
python="${PYTHON:-python}"
mkdir -p "$out/hfsampler/export/attribution_pb" "$out/hfsampler/consumers/cri_pb"
# Only the messages are generated: the clients and the tests' fake kubelet and runtime name their
# gRPC methods themselves, so no *_pb2_grpc module (and its untyped code) is needed.
"$python" -m grpc_tools.protoc \
  --proto_path="$root/proto" \
  --python_out="$out" \
  "$root/proto/hfsampler/export/attribution_pb/podresources.proto" \
  "$root/proto/hfsampler/consumers/cri_pb/cri.proto"
