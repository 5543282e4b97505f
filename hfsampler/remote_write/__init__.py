"""Remote-Write push: encode snapshots into blocks, queue (and spool) them per endpoint, send.

Layers, each with one reason to change: ``encoder`` (windows to blocks), ``relabel``, ``queue`` and
``spool`` (blocks, memory and disk), ``segment`` (the spool's files), ``dirlock`` (one process per
queue directory), ``sender`` (shards and batches), ``retry`` (what an answer means, backoff),
``client`` (HTTP, TLS, auth), ``wire`` (reading encoded requests back).
"""
