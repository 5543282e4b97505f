"""The sim source: deterministic, with spikes, leaks and throttling whose truth tests can read."""

from __future__ import annotations

import os
import threading

import numpy as np

from hfsampler import fields
from hfsampler.sources.sim import source as sim
from hfsampler.sources.sim.source import SW_POWER_CAP_BIT, SimSource

SEC = 1_000_000_000
T0 = 1_800_000_000 * SEC  # a fixed instant: the sim is a function of time


def _read(src: SimSource, names: list[str], t_ns: int) -> tuple[np.ndarray, np.ndarray]:
    chosen = [fields.BY_NAME[n] for n in names]
    values = np.empty((src.gpus, len(chosen)))
    ts = np.empty((src.gpus, len(chosen)), dtype=np.int64)
    src.read(chosen, values, ts, t_ns)
    return values, ts


def test_same_seed_same_signal_other_seed_other_signal() -> None:
    names = ["DCGM_FI_DEV_POWER_USAGE_INSTANT", "DCGM_FI_DEV_GPU_UTIL"]
    a, _ = _read(SimSource(4, seed=1), names, T0)
    b, _ = _read(SimSource(4, seed=1), names, T0)
    c, _ = _read(SimSource(4, seed=2), names, T0)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_read_agrees_with_ground_truth() -> None:
    src = SimSource(3, seed=7)
    name = "DCGM_FI_DEV_POWER_USAGE_INSTANT"
    src.open(fields.CATALOGUE)
    for k in range(0, 2000, 7):
        t = T0 + k * 1_000_000 + 123_456
        values, ts = _read(src, [name], t)
        truth = src.value_at(name, ts[:, 0] * 1000)
        np.testing.assert_array_equal(values[:, 0], truth)


def test_spikes_are_the_window_maximum() -> None:
    src = SimSource(2, seed=3)
    name = "DCGM_FI_DEV_POWER_USAGE_INSTANT"
    grid = T0 + np.arange(0, 20 * SEC, 1_000_000)  # every millisecond for 20 s
    found = 0
    for gpu in range(2):
        series = src.value_at(name, grid, gpu)
        for second in range(20):
            w0, w1 = T0 + second * SEC, T0 + (second + 1) * SEC
            spikes = src.spikes(gpu, w0, w1)
            inside = series[(grid >= w0) & (grid < w1)]
            if spikes:
                found += 1
                assert inside.max() == spikes[0].peak_w
                assert spikes[0].end_ns - spikes[0].start_ns >= 3_000_000
            else:
                assert inside.max() < 600
    assert found >= 10  # about 60 % of seconds carry a spike


def test_repeats_follow_each_fields_refresh_period() -> None:
    src = SimSource(1)
    _, a = _read(src, ["DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_POWER_USAGE_INSTANT"], T0 + 1_000)
    _, b = _read(
        src, ["DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_POWER_USAGE_INSTANT"], T0 + 2_000_000
    )
    assert a[0, 0] == b[0, 0]  # 20 ms refresh: the same driver sample
    assert a[0, 1] != b[0, 1]  # 1 ms refresh: a new one


def test_throttling_sets_reason_bit_lowers_clock_and_counts_violation() -> None:
    src = SimSource(1, seed=5)
    episodes = src.throttles(0, T0, T0 + 100 * SEC)
    assert episodes
    ep = episodes[0]
    mid = (ep.start_ns + ep.end_ns) // 2
    reasons = src.value_at("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", [mid], 0)
    assert int(reasons[0]) & SW_POWER_CAP_BIT
    assert src.value_at("DCGM_FI_DEV_SM_CLOCK", [mid], 0)[0] < 1980
    names = ["DCGM_FI_DEV_POWER_VIOLATION", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]
    before, _ = _read(src, names, mid - 1_000_000)
    after, _ = _read(src, names, mid)
    assert after[0, 0] - before[0, 0] == 1_000_000.0  # 1 ms of throttling, in ns
    assert after[0, 1] > before[0, 1]


def test_framebuffer_leaks() -> None:
    src = SimSource(1)
    used = src.value_at("DCGM_FI_DEV_FB_USED", [T0, T0 + 60 * SEC], 0)
    assert 1000 < used[1] - used[0] < 1400  # 20 MiB/s
    free = src.value_at("DCGM_FI_DEV_FB_FREE", [T0], 0)
    assert free[0] > 0


def test_inventory_labels_are_stable() -> None:
    a = SimSource(2, seed=9).open(fields.CATALOGUE)
    b = SimSource(2, seed=9).open(fields.CATALOGUE)
    assert a.devices == b.devices
    assert a.devices[0].uuid != a.devices[1].uuid
    assert a.devices[1].device == "nvidia1"
    # every field NVML has (a per-link one per link, the last link down on GPU 1 only); none
    # that only a Jetson's sysfs has
    assert a.fields == b.fields
    last = [f.per == "link" and f.labels == (("link", str(sim.NVLINKS - 1)),) for f in a.fields]
    readable = np.array([f.nvml_readable for f in a.fields])
    assert (a.supported[0] == readable).all()
    assert (a.supported[1] == readable & ~np.array(last)).all()
    assert not a.supported[:, [f.jetson == "rail_power" for f in a.fields]].any()
    per_link = [f for f in a.fields if f.per == "link"]
    assert len(per_link) == sim.NVLINKS * sum(f.per == "link" for f in fields.CATALOGUE)


def test_profiles_name_catalogue_fields_and_counters_follow_the_kind() -> None:
    from hfsampler.sources.sim import source as sim

    assert set(sim._PROFILES) <= set(fields.BY_NAME)  # a renamed field would fall to the default
    counters = [f for f in fields.CATALOGUE if f.kind is fields.Kind.COUNTER and f.nvml_readable]
    src = SimSource(1)
    src.open(counters)
    first, _ = _read(src, [f.name for f in counters], T0)
    later, _ = _read(src, [f.name for f in counters], T0 + SEC)
    assert (later >= first).all()  # every counter only grows
    nvlink = [f.name for f in counters].index("hfsampler_nvlink_data_bytes_total")
    assert later[0, nvlink] - first[0, nvlink] == 1.1e11  # its profile's rate, one second


def test_nvlink_per_link_is_deterministic_distinct_per_link_and_nan_where_down() -> None:
    per_link = tuple(f for f in fields.CATALOGUE if f.per == "link")
    inv = SimSource(2, seed=4).open(per_link)
    opened = inv.fields
    tx = fields.BY_NAME["DCGM_FI_DEV_NVLINK_TX_THROUGHPUT_PER_LINK"]
    crc = fields.BY_NAME["DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_PER_LINK_TOTAL"]
    last = str(sim.NVLINKS - 1)

    def run(seed: int) -> np.ndarray:
        src = SimSource(2, seed=seed)
        src.open(per_link)
        out = []
        for k in range(30):  # 3 s at 100 ms
            values = np.zeros((2, len(opened)))
            ts = np.zeros((2, len(opened)), dtype=np.int64)
            src.read(opened, values, ts, T0 + k * 100_000_000)
            out.append(values.copy())
        return np.array(out)

    a, b = run(4), run(4)
    np.testing.assert_array_equal(a, b)  # the same seed, the same numbers, NaN included
    col = {(f.name, dict(f.labels)["link"]): j for j, f in enumerate(opened)}
    t0, t1 = col[(tx.name, "0")], col[(tx.name, "1")]
    assert a[:, 0, t0].tolist() != a[:, 0, t1].tolist()  # each link has its own signal
    assert 2.0e9 < np.nanmean(a[:, :, t0]) < 3.6e9  # B/s, an 18th of the NVLink total
    assert np.isnan(a[:, 1, col[(tx.name, last)]]).all()  # down on GPU 1 only
    assert not np.isnan(a[:, 0, col[(tx.name, last)]]).any()
    errors = a[:, 0, col[(crc.name, "5")]]
    assert (np.diff(errors) >= 0).all()
    assert errors[-1] > errors[0]
    assert not (run(5) == a)[:, :, t0].all()  # another seed, other numbers


def test_value_at_gives_one_link_s_truth() -> None:
    tx = fields.BY_NAME["DCGM_FI_DEV_NVLINK_TX_THROUGHPUT_PER_LINK"]
    link3 = tx.instance("3")
    src = SimSource(2, seed=2)
    (opened,) = src.open((link3,)).fields
    values = np.zeros((2, 1))
    src.read((opened,), values, np.zeros((2, 1), dtype=np.int64), T0 + 250_000_000)
    truth = src.value_at(tx.name, [T0 + 200_000_000] * 2, [0, 1], labels=link3.labels)
    np.testing.assert_array_equal(values[:, 0], truth)
    assert (truth != src.value_at(tx.name, [T0 + 200_000_000] * 2, [0, 1])).all()


def test_rows_computed_ahead_are_the_rows_computed_on_demand() -> None:
    """A reader coming back every millisecond gets its next block from the helper thread; every
    row, across block boundaries and after a jump, is the one a fresh source computes for it."""
    chosen = [f for f in fields.CATALOGUE if f.name in sim._SHAPED or f.name in sim._PROFILES]
    chosen = chosen[:16]
    ahead = SimSource(4, seed=9)
    ahead.open(chosen)
    fast = tuple(chosen)
    t = T0 + 250_000
    for k in range(450):
        if k == 300:
            t += 137_000_000  # missed ticks: past the block computed ahead
        values = np.empty((4, len(fast)))
        ts = np.empty((4, len(fast)), dtype=np.int64)
        ahead.read(fast, values, ts, t)
        fresh = SimSource(4, seed=9)
        fresh.open(chosen)
        want_v, want_ts = _read(fresh, [f.name for f in fast], t)
        np.testing.assert_array_equal(values, want_v)
        np.testing.assert_array_equal(ts, want_ts)
        t += 1_000_000
    assert any(th.name == "hfsampler-sim-ahead" for th in threading.enumerate())
    ahead.close()
    assert not any(th.name == "hfsampler-sim-ahead" for th in threading.enumerate())


def test_a_forked_child_reads_on_without_the_parents_helper() -> None:
    """A block asked of the helper just before a fork is never computed in the child (the
    helper thread is not there): the child computes it itself and its values are the same."""
    chosen = tuple(fields.select(["fast"]))
    src = SimSource(2, seed=4)
    src.open(chosen)
    values = np.empty((2, len(chosen)))
    ts = np.empty((2, len(chosen)), dtype=np.int64)
    for k in range(250):
        src.read(chosen, values, ts, T0 + k * 1_000_000)
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if every row is the fresh source's
        ok = True
        for k in range(250, 500):
            src.read(chosen, values, ts, T0 + k * 1_000_000)
            want, _ = _read(SimSource(2, seed=4), [f.name for f in chosen], T0 + k * 1_000_000)
            ok = ok and np.array_equal(values, want)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    src.close()
    assert os.waitstatus_to_exitcode(status) == 0
