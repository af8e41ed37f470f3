"""common/frame_stack.py: calls under call_on_fresh_chunk never map a new chunk of CPython's frame stack per call.

A call that starts a new chunk maps fresh memory, so it takes a minor page fault when its frame is written: a loop
calling at a chunk's boundary takes one fault a call. Scanning the call depth finds such a boundary without the
reserve (on CPythons without gh-142183's fix) and none under it."""
from __future__ import annotations

import resource
import sys

import pytest

from common.frame_stack import call_on_fresh_chunk

CALLS = 200  # leaf calls at each depth
DEPTHS = 300  # ~40 KiB of at_depth's frames: more than two default chunks, less than the reserved room


def leaf():  # a frame larger than at_depth's, so that some depth leaves less room in its chunk than leaf needs
    a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t = range(20)
    return a


def at_depth(depth: int) -> int:
    """Minor page faults of CALLS calls of leaf() made `depth` frames below here."""
    if depth:
        return at_depth(depth - 1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(CALLS):
        leaf()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def worst_depth() -> int:
    """The most page faults CALLS calls take at any depth up to DEPTHS."""
    return max(at_depth(d) for d in range(DEPTHS))


def test_no_chunk_per_call_under_the_reserve():
    assert call_on_fresh_chunk(worst_depth) < CALLS // 4


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="CPython 3.13 on caches a freed chunk (gh-142183)")
def test_the_scan_finds_a_boundary_without_it():
    assert worst_depth() >= CALLS  # the scan above can fail: a boundary costs a fault a call


def test_returns_and_raises_through():
    assert call_on_fresh_chunk(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(ZeroDivisionError):
        call_on_fresh_chunk(lambda: 1 / 0)
    assert call_on_fresh_chunk(call_on_fresh_chunk, sum, [1, 2]) == 3  # nested
