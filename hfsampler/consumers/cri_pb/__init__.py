"""Generated protobuf messages of the container runtime's CRI API (scripts/gen_proto.sh)."""
