"""Generated protobuf messages of Prometheus's exposition format (scripts/gen_proto.sh)."""
