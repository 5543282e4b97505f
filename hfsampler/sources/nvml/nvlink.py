"""NVLink per link for the nvml source: which links are up on each GPU, and each field's entry.

A per-link field (``Field.per == "link"``) asked for without a label becomes one field per link
that at least one GPU has at open, up or down (``expand``, the ``per`` expansion every source
does; a GPU has link k when ``nvmlDeviceGetNvLinkState`` answers for it at all). A link down at
open is not read until it comes up: links come up after boot, when the fabric manager trains
them, possibly after a DaemonSet started hfsampler. While sampling, the state of every link with
fields is asked again at most once a second (``LinkWatcher.refresh``: one
``nvmlDeviceGetNvLinkState`` per GPU and link, on the lane that reads them), and at once when a
link's entry answers an error: a link that goes down is skipped (its bandwidth series go stale,
its error counters keep their last value, as the driver's do) and read when it comes (back) up.

Each per-link field is one entry of the batched ``nvmlDeviceGetFieldValues`` (``entry``): the
field id ``nvml_field`` names with the link as ``scopeId`` (the bandwidth counters), or, where the
name has a ``{link}`` slot, the per-link id it names once the link is put in (the error counters:
NVML has those ids for links 0 to 11 only, so links 12 and up have bandwidth but no error fields).
The calls come from ``nvml_calls``, the only module that imports ``pynvml``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from hfsampler.fields import Field
from hfsampler.sources.base import BoolArray, IntArray
from hfsampler.sources.nvml import calls

log = logging.getLogger(__name__)

LINK = "link"  # the label that tells a field's links apart
RECHECK_NS = 1_000_000_000  # how often the links' state is asked again while sampling
NOT_A_LINK = -1  # the link of a cell that is not a per-link field's


class Say(Protocol):
    """How an open-time line is logged: at info, or at debug in the sampler process's reopen."""

    def __call__(self, msg: str, /, *args: object) -> None: ...


def link_of(f: Field) -> int | None:
    """The link a per-link field reads (None: not one, or not expanded yet)."""
    value = dict(f.labels).get(LINK) if f.per == LINK else None
    return int(value) if value is not None else None


def constant(f: Field) -> str | None:
    """The pynvml constant a field's entry reads, its ``{link}`` slot filled (for logs too)."""
    link = link_of(f)
    if f.nvml_field is None or "{link}" not in f.nvml_field:
        return f.nvml_field
    return f.nvml_field.format(link=link) if link is not None else None


def entry(f: Field) -> tuple[int | None, int]:
    """(field id, scope id) of the field's batched entry; the id is None where pynvml lacks it."""
    name = constant(f)
    if name is None or unexpanded(f):
        return None, 0
    link = link_of(f)
    scoped = link is not None and "{link}" not in (f.nvml_field or "")
    return calls.field_id(name), (link if scoped and link is not None else 0)


def probe_links(handles: Sequence[Any]) -> list[list[bool]]:
    """Per GPU, whether each of its links is up, link 0 first (none: no NVLink)."""
    states: list[list[bool]] = []
    for handle in handles:
        links: list[bool] = []
        for link in range(calls.NVLINK_MAX_LINKS):
            try:
                links.append(calls.nvlink_active(handle, link))
            except calls.NvmlError:
                break  # INVALID_ARGUMENT past the last link, NOT_SUPPORTED without NVLink
        states.append(links)
    return states


def unexpanded(f: Field) -> bool:
    """A per-link field without its link: one that stays so is read on no GPU."""
    return f.per == LINK and not f.labels


def expand(
    fields: Sequence[Field], states: Sequence[Sequence[bool]], say: Say = log.info
) -> tuple[Field, ...]:
    """Per-link fields without a label become one field per link some GPU has, up or down.

    Where no GPU has a link they stay as they are, supported nowhere, so the fields a source
    opens on GPUs without NVLink are the ones asked for (and discovery drops them).
    """
    up = sorted({k for links in states for k in range(len(links))})
    if not up:
        if any(unexpanded(f) for f in fields):
            say("no GPU has NVLink links: the per-link NVLink fields are skipped")
        return tuple(fields)
    out: list[Field] = []
    lacking: dict[str, list[int]] = {}  # an id pynvml has not for some links: no field there
    for f in fields:
        if f.per == LINK and not f.labels:
            for k in up:
                one = f.instance(str(k))
                if entry(one)[0] is None:
                    lacking.setdefault(f.name, []).append(k)
                else:
                    out.append(one)
        else:
            out.append(f)
    for name, links in lacking.items():
        say("%s: NVML has no field id for link(s) %s: not read there", name,
            ",".join(map(str, links)))  # fmt: skip
    return tuple(out)


def links(fields: Sequence[Field]) -> IntArray:
    """Each field's link (``NOT_A_LINK`` for the other fields)."""
    found = (link_of(f) for f in fields)
    return np.array([NOT_A_LINK if k is None else k for k in found], dtype=np.int64)


class LinkWatcher:
    """Each GPU's link states, asked again at most once per ``RECHECK_NS`` while sampling."""

    def __init__(
        self,
        handles: Sequence[Any],
        states: Sequence[Sequence[bool]],
        fields: Sequence[Field],
        indices: Sequence[int],
        say: Say = log.info,
    ) -> None:
        self._handles = list(handles)
        self._indices = list(indices)  # the GPUs' NVML indices, for the logs
        self._count = np.array([len(s) for s in states], dtype=np.int64)  # links per GPU
        width = max((len(s) for s in states), default=0)
        self.active: BoolArray = np.zeros((len(states), max(width, 1)), dtype=np.bool_)
        for g, links in enumerate(states):
            self.active[g, : len(links)] = links
        self._ever_up = self.active.copy()  # a link up once is "up again", one never up "up"
        wanted = {k for f in fields if (k := link_of(f)) is not None}
        # per GPU, the links watched: every link it has with fields, down at open or not
        self._watched = [sorted(k for k in wanted if k < len(s)) for s in states]
        self._checked_ns = 0
        self._due = False  # a link's entry answered an error: ask again on the next read
        for g, links in enumerate(states):
            if links and not all(links):
                down = [k for k, a in enumerate(links) if not a]
                say(
                    "GPU %d: NVLink link(s) %s not up at start: read once up (asked once a "
                    "second)",
                    self._indices[g], ",".join(map(str, down)),
                )  # fmt: skip

    def present(self, links: IntArray) -> BoolArray:
        """[gpu, cell]: the cell is not a link's, or its GPU has that link (up or down)."""
        out: BoolArray = (links < 0)[None, :] | (links[None, :] < self._count[:, None])
        return out

    def cells(self, links: IntArray) -> BoolArray:
        """[gpu, cell]: the cell is not a link's, or its link is up now."""
        inside = (links >= 0) & (links < self.active.shape[1])
        picked = self.active[:, np.where(inside, links, 0)]
        out: BoolArray = np.where(links >= 0, picked & inside, True)
        return out

    def recheck(self) -> None:
        """Ask the states again on the next ``refresh``: a link's entry answered an error."""
        self._due = True

    def refresh(self, now_ns: int, up: BoolArray) -> None:
        """Ask the links' state again once ``RECHECK_NS`` has passed since the last time."""
        if not self._checked_ns:  # the states from open are fresh: the clock starts here
            self._checked_ns = now_ns
        if now_ns - self._checked_ns < RECHECK_NS and not self._due:
            return
        self._checked_ns, self._due = now_ns, False
        for g, handle in enumerate(self._handles):
            if not up[g]:
                continue
            for k in self._watched[g]:
                try:
                    active = calls.nvlink_active(handle, k)
                except calls.NvmlError as e:
                    if int(e.value) in calls.LOST_CODES:
                        break  # the GPU's own reads find it lost and take it down
                    active = False
                if active != self.active[g, k]:
                    self.active[g, k] = active
                    if active and not self._ever_up[g, k]:
                        self._ever_up[g, k] = True
                        log.info("GPU %d: NVLink link %d came up: read from now on",
                                 self._indices[g], k)  # fmt: skip
                        continue
                    log.warning(
                        "GPU %d: NVLink link %d %s", self._indices[g], k,
                        "is up again: read again" if active else "went down: not read while down",
                    )  # fmt: skip
