"""The worst-case matching cost of a regex over a bounded string, so that a pattern a user
configures (the pod-label allowlist) cannot be made to backtrack for hours by a string someone
else chooses (a tenant's pod label key).

Python's ``re`` backtracks, holds the GIL while it does, and cannot be interrupted from another
thread: ``(a+)+$`` over 63 ``a`` and a ``-`` (a valid label key) runs for days and freezes every
thread of the service. So a pattern is refused where a repeat holds another repeat or an
alternation (the shapes whose paths grow exponentially with the string), or where its paths
over a string of ``max_chars`` counted as the product of its repeats' lengths and the sum of
its alternatives exceed ``max_paths`` (``.*a.*b.*c``: cubic).
"""

from __future__ import annotations

from re import _constants as sre  # type: ignore[attr-defined]
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Any

_REPEATS = {sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT}
_GROUPS = {sre.SUBPATTERN, sre.ATOMIC_GROUP, sre.ASSERT, sre.ASSERT_NOT}


class TooCostly(ValueError):
    """A pattern whose matching may take far too long; the message says which part."""


def _body(op: Any, av: Any) -> Any:
    if op is sre.SUBPATTERN:
        return av[3]
    if op is sre.ATOMIC_GROUP:
        return av
    return av[1]  # ASSERT, ASSERT_NOT: (direction, pattern)


def _has_choice(items: Any) -> bool:
    """Whether a repeat's body holds a choice: a repeat of varying length or alternatives."""
    for op, av in items:
        if (op in _REPEATS and av[1] > av[0]) or op is sre.BRANCH or op is sre.GROUPREF_EXISTS:
            return True
        if op in _GROUPS and _has_choice(_body(op, av)):
            return True
    return False


def _paths(items: Any, max_chars: int) -> int:
    out = 1
    for op, av in items:
        if op in _REPEATS:
            low, high, body = av
            if high > 1 and _has_choice(body):
                raise TooCostly("a repeat of a repeat or of alternatives (e.g. (a+)+ or (a|b)*)")
            out *= (min(high, max_chars) - low + 1) * _paths(body, max_chars)
        elif op is sre.BRANCH:
            out *= sum(_paths(alt, max_chars) for alt in av[1])
        elif op is sre.GROUPREF_EXISTS:
            out *= _paths(av[1], max_chars) + (_paths(av[2], max_chars) if av[2] else 1)
        elif op in _GROUPS:
            out *= _paths(_body(op, av), max_chars)
    return out


def check(pattern: str, max_chars: int, max_paths: int) -> None:
    """Raise ``TooCostly`` where matching ``pattern`` against a string of up to ``max_chars``
    characters may try more than ``max_paths`` ways; ``re.error`` where it is no regex."""
    paths = _paths(sre_parse.parse(pattern), max_chars)
    if paths > max_paths:
        raise TooCostly(
            f"about {paths:.1e} ways to try over a {max_chars}-character key (most {max_paths:.0e})"
        )
