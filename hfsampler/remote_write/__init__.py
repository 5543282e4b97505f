"""Remote-Write push: snapshots into neutral blocks, queued (and spooled) per endpoint, sent as
1.0 or 2.0.

Layers, each with one reason to change: ``blocks`` (the neutral form: per-series labels, sample
arrays; merge and split), ``protowrite`` and ``arrays`` (protobuf writing), ``encoder`` (labels
once per series, blocks, 1.0 requests), ``encoder_v2`` (2.0 requests), ``relabel``, ``intake``
(push: relabel, metadata, shards), ``queue`` and ``spool`` (blocks, memory and disk),
``segment`` (the spool's files), ``dirlock`` (one process per queue directory), ``delivery``
(shard loops, 413 splitting, 2.0 negotiation), ``episode`` (how retries and refusals are
logged), ``handover`` (a replaced writer stopped at safe points, its backlog for the next),
``retry`` (what an answer means, backoff), ``client`` (HTTP, TLS, auth, redirects).
"""
