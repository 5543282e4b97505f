"""Generated protobuf messages of the kubelet pod-resources API (scripts/gen_attribution_proto.sh)."""
