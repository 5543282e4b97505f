"""``hashmod`` gives the shard real Prometheus gives, on both versions.

Prometheus applies the same relabel action to scrape targets; ``/api/v1/targets`` shows the
labels each target ends up with. A static config of many targets, sharded by ``__address__`` and
by two joined labels, must land every target in the shard hfsampler's ``write_relabel_configs``
computes for the same label set. The targets are unused loopback ports: nothing is scraped.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import receivers as rx

from hfsampler.remote_write.relabel import apply, parse_rules

pytestmark = pytest.mark.integration

TARGETS = [f"127.0.0.1:{port}" for port in range(1, 201)]
RULES = [
    {"source_labels": ["__address__"], "target_label": "shard", "modulus": 7, "action": "hashmod"},
    # a modulus past 32 bits, and a separator between two joined labels
    {
        "source_labels": ["site", "__address__"],
        "separator": "/",
        "target_label": "bucket",
        "modulus": 2**40 + 15,
        "action": "hashmod",
    },
]


def test_hashmod_matches_prometheus(tmp_path: Path, prometheus_build: rx.PrometheusBuild) -> None:
    scrape = {
        "job_name": "shards",
        "scrape_interval": "1h",
        "static_configs": [{"targets": TARGETS, "labels": {"site": "fra1"}}],
        "relabel_configs": RULES,
    }
    prom = rx.start_prometheus(
        tmp_path, [scrape], name=f"{prometheus_build.name}-hashmod", binary=prometheus_build.binary
    )
    try:
        active: list[dict[str, object]] = []
        for _ in range(100):
            active = prom.api("/api/v1/targets", {"state": "active"})["data"]["activeTargets"]
            if len(active) == len(TARGETS):
                break
            time.sleep(0.1)
    finally:
        prom.stop()
    assert len(active) == len(TARGETS)
    rules = parse_rules(RULES, "write_relabel_configs")
    shards = set()
    for target in active:
        labels = target["labels"]
        assert isinstance(labels, dict)
        ours = apply(rules, {"__address__": labels["instance"], "site": "fra1", "__name__": "x"})
        assert ours is not None
        assert (ours["shard"], ours["bucket"]) == (labels["shard"], labels["bucket"]), labels
        shards.add(labels["shard"])
    assert shards == {str(i) for i in range(7)}
