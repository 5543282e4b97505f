"""Per-consumer series: counters that add up to the GPU's energy, a cap per GPU with the rest
folded into consumer="other", stale markers for consumers and rows that leave, bounded under
churn."""

from __future__ import annotations

import math
import random

import pytest

from hfsampler.consumers.identity import Consumer, Kind
from hfsampler.consumers.split import WindowUse, split
from hfsampler.export import consumer_series as cs
from hfsampler.export.consumer_series import ConsumerSeries
from hfsampler.series import Series, SeriesRegistry, is_stale

GPU0 = {"gpu": "0", "UUID": "GPU-0", "Hostname": "n1"}
GPU1_MIG = {"gpu": "1", "UUID": "GPU-1", "GPU_I_ID": "2", "Hostname": "n1"}


def job(n: int) -> Consumer:
    return Consumer(Kind.HPC_JOB, hpc_job=str(n))


def labels_of(c: Consumer) -> dict[str, str]:
    return c.labels()


def window(energy_j: float, busy: dict[int, float]) -> object:
    """A split where pid n is job n at ``busy[n]`` percent SM, 1 GiB each."""
    use = WindowUse.of(
        energy_j,
        [(pid, 0, pct) for pid, pct in busy.items()],
        [(pid, 0, float(1 << 30)) for pid in busy],
    )
    return split(use, {pid: job(pid) for pid in busy})


def values(out: tuple[list[Series], list[float]]) -> dict[tuple[str, str], float]:
    """(metric, consumer's or row's distinguishing label) -> value."""
    got = {}
    for s, v in zip(*out, strict=True):
        labels = dict(s.labels)
        who = labels.get("hpc_job") or labels.get("consumer") or labels["gpu"]
        got[(s.name, who)] = v
    return got


def test_counters_add_up_to_the_gpu_energy() -> None:
    model = ConsumerSeries(SeriesRegistry(), external={"cluster": "c1"})
    total = 0.0
    for energy, busy in ((100.0, {1: 30.0, 2: 10.0}), (50.0, {1: 0.0, 2: 0.0}), (80.0, {2: 40.0})):
        out = model.window([(GPU0, window(energy, busy))], labels_of)
        total += energy
    got = values(out)
    assert got[(cs.ENERGY, "2")] == pytest.approx(25.0 + 80.0)  # a quarter of 100 J, then all
    assert got[(cs.UNATTRIBUTED, "0")] == pytest.approx(50.0)
    assert is_stale(got[(cs.ENERGY, "1")])  # job 1 left in the third window
    assert got[(cs.ENERGY, "2")] + 75.0 + got[(cs.UNATTRIBUTED, "0")] == pytest.approx(total)
    s = next(s for s, v in zip(*out, strict=True) if s.name == cs.SM_RATIO and not is_stale(v))
    assert dict(s.labels) == {**GPU0, "hpc_job": "2", "cluster": "c1"}


def test_cap_folds_the_rest_into_other_and_counts_them() -> None:
    model = ConsumerSeries(SeriesRegistry(), max_per_gpu=2)
    busy = {1: 10.0, 2: 10.0, 3: 20.0, 4: 20.0}
    got = values(model.window([(GPU0, window(60.0, busy))], labels_of))
    assert {k for k in got if k[0] == cs.ENERGY} == {(cs.ENERGY, "1"), (cs.ENERGY, "2"),
                                                     (cs.ENERGY, "other")}  # fmt: skip
    assert got[(cs.ENERGY, "other")] == pytest.approx(40.0)
    assert got[(cs.SM_RATIO, "other")] == pytest.approx(0.4)
    assert got[(cs.MEMORY_USED, "other")] == 2 * (1 << 30)
    assert got[(cs.FOLDED, "0")] == 2.0
    # job 1 leaves: its place goes to job 3; job 4 is alone in "other"
    got = values(model.window([(GPU0, window(60.0, {2: 10.0, 3: 20.0, 4: 20.0}))], labels_of))
    assert is_stale(got[(cs.ENERGY, "1")])
    assert got[(cs.ENERGY, "3")] == pytest.approx(24.0)
    assert got[(cs.FOLDED, "0")] == 1.0
    # nothing folded: "other" ends
    got = values(model.window([(GPU0, window(60.0, {2: 10.0}))], labels_of))
    assert is_stale(got[(cs.ENERGY, "other")])
    assert got[(cs.FOLDED, "0")] == 0.0


def test_a_row_that_goes_ends_all_its_series() -> None:
    registry = SeriesRegistry()
    model = ConsumerSeries(registry)
    model.window([(GPU0, window(10.0, {1: 50.0})), (GPU1_MIG, window(5.0, {7: 20.0}))], labels_of)
    out = model.window([(GPU0, window(10.0, {1: 50.0}))], labels_of)
    ended = {
        s.name for s, v in zip(*out, strict=True) if is_stale(v) and ("GPU_I_ID", "2") in s.labels
    }
    assert ended == {cs.SM_RATIO, cs.MEMORY_USED, cs.ENERGY, cs.UNATTRIBUTED, cs.FOLDED}
    series, vals = model.end_all()
    assert all(is_stale(v) for v in vals)
    assert len(series) == 5
    assert len(registry) == 0


def test_names_add_labels_but_never_replace_the_gpu_s() -> None:
    model = ConsumerSeries(SeriesRegistry())
    out = model.window([(GPU0, window(1.0, {1: 5.0}))],
                       lambda c: {**c.labels(), "pod": "p", "gpu": "9"})  # fmt: skip
    assert all(("gpu", "0") in s.labels and ("pod", "p") in s.labels
               for s in out[0] if s.name == cs.ENERGY)  # fmt: skip


def test_a_pod_s_labels_never_replace_the_operator_s_external_labels() -> None:
    # a tenant's pod labelled cluster=c2 must not bill its GPU energy to another cluster
    model = ConsumerSeries(SeriesRegistry(), external={"cluster": "c1", "pod": "ext"})
    out = model.window([(GPU0, window(1.0, {1: 5.0}))],
                       lambda c: {**c.labels(), "pod": "p", "cluster": "c2"})  # fmt: skip
    energy = [dict(s.labels) for s in out[0] if s.name == cs.ENERGY]
    assert energy == [{**GPU0, "hpc_job": "1", "pod": "p", "cluster": "c1"}]


def test_two_consumers_named_alike_are_one_series_not_two_samples_at_one_timestamp() -> None:
    # a process may name itself "" (prctl PR_SET_NAME): its command label is then "unknown",
    # as another's named "unknown" is; two samples of one series at one timestamp would have a
    # receiver refuse the write
    nameless = Consumer(Kind.COMMAND, uid=1000, command="")
    named = Consumer(Kind.COMMAND, uid=1000, command="unknown")
    use = WindowUse.of(10.0, [(1, 0, 20.0), (2, 0, 30.0)], [(1, 0, 1.0), (2, 0, 2.0)])
    out = ConsumerSeries(SeriesRegistry()).window(
        [(GPU0, split(use, {1: nameless, 2: named}))], labels_of
    )
    ids = [s.id for s in out[0]]
    assert len(ids) == len(set(ids))
    energy = [v for s, v in zip(*out, strict=True) if s.name == cs.ENERGY]
    assert energy == [pytest.approx(10.0)]


def test_no_memory_no_memory_series() -> None:
    model = ConsumerSeries(SeriesRegistry())
    use = WindowUse.of(1.0, [(1, 0, 50.0)], [(1, 0, None)])
    out = model.window([(GPU0, split(use, {1: job(1)}))], labels_of)
    assert cs.MEMORY_USED not in {s.name for s in out[0]}
    out = model.window([(GPU0, split(WindowUse.of(1.0), {}))], labels_of)
    assert cs.MEMORY_USED not in {s.name for s in out[0]}  # not even a stale marker


def test_churn_is_bounded_and_every_leaver_ends() -> None:
    """Consumers start and leave every few windows for 600 windows (a 10-minute run at 1 s)."""
    rng = random.Random(25)
    registry = SeriesRegistry()
    model = ConsumerSeries(registry, max_per_gpu=16)
    live: dict[int, int] = {}  # pid -> windows left
    next_pid = 1
    started: set[str] = set()
    ended: set[str] = set()
    most = 0
    for _ in range(600):
        for pid in [p for p, left in live.items() if left <= 0]:
            del live[pid]
        while len(live) < 24 and rng.random() < 0.5:
            live[next_pid] = rng.randint(2, 8)
            next_pid += 1
        busy = {pid: rng.uniform(0, 30) for pid in live}
        energy = rng.uniform(50, 500)
        out = model.window([(GPU0, window(energy, busy))], labels_of)
        for s, v in zip(*out, strict=True):
            who = dict(s.labels).get("hpc_job")
            if who and s.name == cs.ENERGY:
                (ended if is_stale(v) else started).add(who)
        live = {p: left - 1 for p, left in live.items()}
        most = max(most, len(registry))
        total = sum(v for s, v in zip(*out, strict=True)
                    if s.name in (cs.ENERGY, cs.UNATTRIBUTED) and not math.isnan(v))  # fmt: skip
        assert total > 0
    assert most <= 3 * 17 + 2  # 16 consumers and "other", 3 series each, and the row's 2
    assert started - ended <= {str(p) for p in live}  # every one that left was ended
    assert len(started) > 100
    model.end_all()
    assert len(registry) == 0
