#!/usr/bin/env bash
# Regenerates hfsampler/remote_write/prompb/*_pb2.py (Remote-Write 1.0 and 2.0) from proto/.
# Usage: scripts/gen_proto.sh [OUT_ROOT]   (OUT_ROOT defaults to the repository root; the staleness
# test passes a temporary directory and compares the result with the committed modules.)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root}"
python="${PYTHON:-python}"
mkdir -p "$out/hfsampler/remote_write/prompb"
# The .proto files sit under proto/ at their package path so that protoc writes absolute imports
# (from hfsampler.remote_write.prompb import types_pb2) that resolve inside the installed package.
"$python" -m grpc_tools.protoc \
  --proto_path="$root/proto" \
  --python_out="$out" \
  "$root/proto/hfsampler/remote_write/prompb/types.proto" \
  "$root/proto/hfsampler/remote_write/prompb/remote.proto" \
  "$root/proto/hfsampler/remote_write/prompb/writev2.proto"
