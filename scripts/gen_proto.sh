#!/usr/bin/env bash
# Regenerates every *_pb2.py module from its .proto under proto/: Remote-Write 1.0 and 2.0
# (hfsampler/remote_write/prompb), Prometheus's exposition format (export/exposition_pb), the
# kubelet's pod-resources API (export/attribution_pb) and the container runtime's CRI
# (consumers/cri_pb). Usage: scripts/gen_proto.sh [OUT_ROOT]   (OUT_ROOT defaults to the
# repository root; the staleness test passes a temporary directory and compares the result with
# the committed modules.)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root}"
python="${PYTHON:-python}"
cd "$root/proto"
mapfile -t protos < <(find hfsampler -name '*.proto' | LC_ALL=C sort)
for proto in "${protos[@]}"; do mkdir -p "$out/$(dirname "$proto")"; done
# The .proto files sit under proto/ at their package path so that protoc writes absolute imports
# (from hfsampler.remote_write.prompb import types_pb2) that resolve inside the installed package.
# Only messages are generated: the gRPC clients and the tests' fake kubelet and runtime name their
# methods themselves, so no *_pb2_grpc module (and its untyped code) is needed.
"$python" -m grpc_tools.protoc --proto_path=. --python_out="$out" "${protos[@]}"
