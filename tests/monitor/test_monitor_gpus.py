"""Which GPUs a Monitor measures, from the environment a launcher gives the job.

On the fake NVML with a ``VirtualClock``: the Monitor samples in this process, nothing starts.
"""

from __future__ import annotations

import pytest
from fake_nvml import enable_mig, install, make_fake

from hfsampler import Monitor
from hfsampler.errors import ConfigError
from hfsampler.sampling.stepping import VirtualClock

START_NS = 1_780_000_000 * 10**9
# GPU 1's MIG instances, as the fake names them (its index, then the GPU instance id)
MIG_A = "MIG-00000001-0001-4444-5555-666677778888"
MIG_B = "MIG-00000001-0002-4444-5555-666677778888"


@pytest.fixture
def mig_gpu_1(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = make_fake(2)
    enable_mig(fake.gpus[1], 1, [(1, "3g.71gb"), (2, "3g.71gb")])
    install(monkeypatch, fake)


def gpus(env: dict[str, str]) -> dict[str, str]:
    """cuda:N -> the UUID of the GPU the Monitor measures for it."""
    with Monitor(source="nvml", clock=VirtualClock(START_NS), env=env) as mon:
        devices = mon._plan.inventory.devices
        return {f"cuda:{i}": devices[row].uuid for i, row in mon.gpus.items()}


@pytest.mark.usefixtures("mig_gpu_1")
def test_a_mig_instance_in_cuda_visible_devices_is_measured_on_its_gpu() -> None:
    """A job given a MIG instance (``CUDA_VISIBLE_DEVICES=MIG-...``, as Kubernetes' device plugin
    does) draws its power on the instance's GPU: that GPU is what there is to measure."""
    gpu_1 = gpus({})["cuda:1"]
    with pytest.warns(UserWarning, match="whole GPU"):
        assert gpus({"CUDA_VISIBLE_DEVICES": MIG_B}) == {"cuda:0": gpu_1}
    # CUDA shows a process one MIG instance: the first listed
    with pytest.warns(UserWarning, match="whole GPU"):
        assert gpus({"CUDA_VISIBLE_DEVICES": f"{MIG_A},{MIG_B}"}) == {"cuda:0": gpu_1}
    # the older form, MIG-<GPU UUID>/<GPU instance>/<compute instance>
    with pytest.warns(UserWarning, match="whole GPU"):
        assert gpus({"CUDA_VISIBLE_DEVICES": f"MIG-{gpu_1}/1/0"}) == {"cuda:0": gpu_1}
    with pytest.raises(ConfigError, match="names no GPU"):
        gpus({"CUDA_VISIBLE_DEVICES": "MIG-ffffffff"})


def test_a_local_rank_beyond_the_visible_gpus_is_named_as_such(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``LOCAL_RANK=3`` on a machine that shows the job two GPUs: the error names LOCAL_RANK, not
    a ``gpu_indices`` the job never gave."""
    install(monkeypatch, make_fake(2))
    with pytest.raises(ConfigError, match=r"^LOCAL_RANK: 3 is not a GPU this job sees"):
        gpus({"LOCAL_RANK": "3"})
    assert list(gpus({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "1"})) == ["cuda:0"]


def test_an_entry_cuda_cannot_use_is_refused_with_a_fix_that_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``CUDA_VISIBLE_DEVICES=-1`` (a CPU-only run) or a typo is refused even with ``gpu_indices``
    given, so the fix must not be to give them."""
    install(monkeypatch, make_fake(2))
    for listed in ("-1", "garbage", "0,7"):
        with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES") as refused:
            Monitor(source="nvml", gpu_indices=[0], clock=VirtualClock(START_NS),
                    env={"CUDA_VISIBLE_DEVICES": listed})  # fmt: skip
        assert "gpu_indices" not in str(refused.value)
