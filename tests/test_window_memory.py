"""A sliding window given as a mask function costs no more memory than it must (issue 55, item 4).

Dimensions: B batch, H heads, L length, D head dim, n queries of a block.

Each call is measured as the issue's check does: in a fresh process, after one warm-up call, with glibc's
mmap threshold fixed (:func:`multihead.bench.measure.track_cpu_memory`), as the peak resident growth of one
call. A two-sided lambda window of 512 on the blocked backend holds, beside the output, one span's kernel
output and no partial sums: its growth at L = 4,096 (H = 8, D = 64, float32) was 14.4-15.6 MiB against the
unmasked call's 8.4 when the spans were joined out of place, 9.4-9.6 in place (Zen 1).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from multihead.bench.window_memory import growth


def _growth(length: int, kind: str) -> float:
    """MiB of peak resident growth of one call (``kind``: "window" or "plain") in a fresh process."""
    return growth(length, kind, timeout=300)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak RSS reset")
def test_a_window_grows_the_heap_by_no_more_than_a_block_of_its_output():
    n = 4096
    plain, window = _growth(n, "plain"), _growth(n, "window")
    output = 8 * n * 64 * 4 / 2**20  # (1, 8, L, 64) float32: 8 MiB, which both must hold
    assert plain >= output * 0.99  # the measurement sees the output (a broken one would pass anything)
    # beside the output: one block's kernel output (1, 8, 256, 64) = 0.5 MiB, its float mask and the mask's
    # evaluation on one tile; out of place the join held five such blocks and grew 6-7 MiB more than plain.
    # Where the freed blocks land in the heap varies between processes: 9.4-9.7 MiB in most, 11.7-13.6 in about
    # one in three (Zen 1). The least of up to 5 processes is read (the old join never fell below 14.4).
    tries = [window]
    while window - plain > 2.0 and len(tries) < 5:
        window = _growth(n, "window")
        tries.append(window)
    assert window - plain <= 2.0, (tries, plain)
