"""The rows behind ``tests/data/recording-v1.hfs``: a recording written by format 1's writer.

Format 1 stored each window's statistics by position (min, max, mean, p99, last, then count)
and named none of them. The fixture was written once, by the writer of commit 8b4476c, from these
rows; the tests read it with today's reader and compare against today's reduction of the same rows.
"""

from __future__ import annotations

import numpy as np

from hfsampler.fields import BY_NAME
from hfsampler.sampling.groups import GroupPlan
from hfsampler.sampling.ring import RingRows
from hfsampler.sources.base import DeviceInfo

START_NS = 1_800_000_000 * 10**9
WINDOW_NS = 100_000_000
WINDOWS = 3
DEVICES = tuple(
    DeviceInfo(i, f"GPU-{i:08x}-v1", "test H200", f"00000000:{0x18 + i:02X}:00.0", "550.0", i)
    for i in range(2)
)
GROUPS = (
    GroupPlan("fast", 0.001, (BY_NAME["DCGM_FI_DEV_POWER_USAGE_INSTANT"],
                              BY_NAME["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"])),
    GroupPlan("slow", 0.01, (BY_NAME["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"],
                             BY_NAME["DCGM_FI_DEV_GPU_TEMP"])),
)  # fmt: skip


def rows(group: int, window: int) -> RingRows:
    """One group's ring rows for one window: whole numbers (exact in float32), some repeats."""
    step = int(GROUPS[group].interval_s * 1e9)
    n = WINDOW_NS // step
    tick = window * n + np.arange(n, dtype=np.int64)  # ticks since the start
    time_ns = START_NS + tick * step
    gpu = np.arange(2, dtype=np.int64)[None, :]
    t = tick[:, None]
    values = np.empty((n, 2, 2))
    if group == 0:
        values[:, :, 0] = 300 + (t * 37 + gpu * 50) % 400  # power, W
        values[:, :, 1] = np.where((t + gpu) % 9 < 2, 4.0, 0.0)  # SW power cap bit
        values[:, :, 1] = np.where(t % 23 == 5, 8.0, values[:, :, 1])
    else:
        values[:, :, 0] = 1e12 + (t * (t + 1) // 2) * 1000 + gpu  # energy, mJ
        values[:, :, 1] = 50 + t % 7 + gpu  # temperature, C
    driver = np.broadcast_to((time_ns // 1000)[:, None, None], values.shape).copy()
    repeat = (t + gpu) % 4 == 3  # the driver had nothing new: the sampler's NaN
    values[np.broadcast_to(repeat[:, :, None], values.shape)] = np.nan
    return RingRows(time_ns, (tick % 5) * 1000, values, driver)
