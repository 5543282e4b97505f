"""Generated Remote-Write 1.0 protobuf modules (scripts/gen_proto.sh); the encoder's reference."""
