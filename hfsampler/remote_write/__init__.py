"""Remote-Write 1.0 push: encode snapshots, queue them per endpoint, send them with retries."""

from hfsampler.remote_write.config import (
    EndpointConfig,
    QueueConfig,
    endpoint_from_url,
    parse_duration,
    parse_remote_write,
    redact_url,
)
from hfsampler.remote_write.encoder import Encoder, QueuedSample, compress, encode_metadata
from hfsampler.remote_write.queue import MemoryQueue, ShardQueue
from hfsampler.remote_write.sender import RemoteWriter, define_metrics

__all__ = [
    "Encoder",
    "EndpointConfig",
    "MemoryQueue",
    "QueueConfig",
    "QueuedSample",
    "RemoteWriter",
    "ShardQueue",
    "compress",
    "define_metrics",
    "encode_metadata",
    "endpoint_from_url",
    "parse_duration",
    "parse_remote_write",
    "redact_url",
]
