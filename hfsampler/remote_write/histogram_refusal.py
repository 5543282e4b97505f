"""Histogram refusal: how a receiver says it takes no native histograms, and what the endpoint
does then. Its histograms are dropped from then on, counted (``histograms_refused``) and said
once; each request goes on with its float series alone (``delivery``), and intake stops queueing
histograms for it. Nothing else is lost.

Prometheus 2.42 and 3.5 without ``--enable-feature=native-histograms`` answer a request holding a
histogram with 500 "native histograms are disabled" (tests/integration/test_native_histograms.py;
prometheus/prometheus#17181 makes it a 422 later), which would otherwise be retried for ever; a
400 or 422 that names histograms is taken as the same refusal.

An endpoint that no longer asks for them (``send_native_histograms`` turned off, or
``histograms:`` emptied, since the spool or a reload's queue took them) has them dropped the same
way before sending, counted as ``histograms_not_asked``: never sent where not asked, never lost
without a count.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import replace

from hfsampler.errors import NonRecoverableSendError, RecoverableSendError, RequestTooLargeError
from hfsampler.remote_write.blocks import Block
from hfsampler.remote_write.config import EndpointConfig

log = logging.getLogger(__name__)

# "histogram" as a word of the answer's own, not the tail of a series name (``..._histogram``):
# Prometheus 3 answers an out-of-order or too-old sample of a 2.0 request with a 400 naming each
# series ("out of order sample for series {__name__=\"DCGM_FI_DEV_POWER_USAGE_histogram\", ...}"),
# which is no refusal of histograms; label sets are taken out before looking.
_HISTOGRAM_WORDS = re.compile(r"(?<![\w:])histogram", re.I)
_LABEL_SETS = re.compile(r"\{[^{}]*\}")
# A refusal of some samples for their timestamps, histograms among them (Prometheus's and Mimir's
# "out-of-order native histogram ingestion is disabled", 400): that request's, not a refusal of
# every histogram to come.
_PER_SAMPLE = re.compile(r"out[- ]of[- ](?:order|bounds)|too old|duplicate sample", re.I)
_HISTOGRAMS_DISABLED = re.compile(r"native histograms? (?:are |is )?(?:disabled|not enabled)", re.I)
REASON = "histograms_refused"  # the drop counter's reason
NOT_ASKED = "histograms_not_asked"  # queued while asked for, to send after it no longer is


def refusal(block: Block, err: Exception) -> str | None:
    """Why ``err``, the answer to a request of ``block``, refuses its native histograms (the
    answer, for the log); None when it is no such refusal."""
    if block.hist is None or _PER_SAMPLE.search(str(err)):
        return None
    if isinstance(err, RecoverableSendError):
        return str(err) if _HISTOGRAMS_DISABLED.search(str(err)) else None
    if (
        isinstance(err, NonRecoverableSendError)
        and not isinstance(err, RequestTooLargeError)
        and err.status in (400, 422)
        and _HISTOGRAM_WORDS.search(_LABEL_SETS.sub("", err.text))
    ):
        return f"HTTP {err.status}: {err.text}"
    return None


class HistogramRefusal:
    """Whether an endpoint's receiver refused native histograms, and dropping them if so."""

    def __init__(self, config: EndpointConfig, drop: Callable[[int, str], None]) -> None:
        self.config = config
        self._drop = drop
        self.refused = False
        self._said_not_asked = False

    @property
    def dropping(self) -> bool:
        """Whether this endpoint's queued histograms are dropped before sending: refused, or
        queued (spooled, handed over) under a config that asked for them and this one not."""
        return self.refused or not self.config.send_native_histograms

    def refuse(self, why: str) -> None:
        """The receiver refused them (``why``: its answer, already log-safe): said once."""
        if self.refused:
            return
        self.refused = True
        log.error(
            "remote write %s (%s) refuses native histograms (%s): this endpoint's histogram "
            "series are dropped from now on, counted as %s, and its other series still sent; "
            "enable native histograms on the receiver (--enable-feature=native-histograms) or "
            "set send_native_histograms: false",
            self.config.remote_name,
            self.config.display_url,
            why[:300],
            REASON,
        )

    def strip(self, block: Block) -> tuple[Block, int]:
        """``block`` without its histogram series, and how many samples those were (dropped
        and counted)."""
        if block.hist is None:
            return block, 0
        floats = block.without_histograms()
        # nor their families' metadata: an endpoint that gets no histogram hears of none
        families = tuple(f for f in floats.families if f.type != "histogram")
        if families != floats.families:
            floats = replace(floats, families=families)
        dropped = block.samples - floats.samples
        reason = REASON if self.refused else NOT_ASKED
        if reason == NOT_ASKED and not self._said_not_asked:
            self._said_not_asked = True
            log.warning(
                "remote write %s (%s): its queue holds native histograms from a config that "
                "sent them, and send_native_histograms is now off: they are dropped, counted "
                "as %s, and their float series sent",
                self.config.remote_name,
                self.config.display_url,
                NOT_ASKED,
            )
        self._drop(dropped, reason)
        return floats, dropped
