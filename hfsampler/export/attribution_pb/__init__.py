"""Generated protobuf messages of the kubelet pod-resources API (scripts/gen_proto.sh)."""
