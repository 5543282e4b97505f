"""Remote-Write 1.0 push: encode snapshots into blocks, queue (and spool) them per endpoint, send.

Layers, each with one reason to change: ``encoder`` (windows to blocks), ``relabel``, ``queue`` and
``spool`` (blocks, memory and disk), ``segment`` (the spool's files), ``dirlock`` (one process per
queue directory), ``sender`` (shards and batches), ``retry`` (what an answer means, backoff),
``client`` (HTTP, TLS, auth), ``wire`` (reading encoded requests back).
"""

from hfsampler.remote_write.config import (
    EndpointConfig,
    QueueConfig,
    endpoint_from_url,
    parse_remote_write,
    redact_url,
)
from hfsampler.remote_write.encoder import (
    Block,
    BlockEncoder,
    Encoder,
    QueuedSample,
    compress,
    encode_metadata,
)
from hfsampler.remote_write.queue import Batch, MemoryQueue, ShardQueue
from hfsampler.remote_write.sender import RemoteWriter
from hfsampler.remote_write.spool import SpoolQueue

__all__ = [
    "Batch",
    "Block",
    "BlockEncoder",
    "Encoder",
    "EndpointConfig",
    "MemoryQueue",
    "QueueConfig",
    "QueuedSample",
    "RemoteWriter",
    "ShardQueue",
    "SpoolQueue",
    "compress",
    "encode_metadata",
    "endpoint_from_url",
    "parse_remote_write",
    "redact_url",
]
