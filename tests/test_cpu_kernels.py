"""The tools that keep the numerics honest on every CPU: the capabilities probe and the merge floor."""

import os

import pytest
import torch

from multihead.testing import CPU_CAPABILITIES, cpu_capabilities, merge_floor


@pytest.mark.skipif("ATEN_CPU_CAPABILITY" in os.environ, reason="probes torch's own pick, unset here")
def test_capabilities_probe_ends_with_torchs_own_pick():
    caps = cpu_capabilities()
    assert caps[0] == "default"  # every CPU runs the unvectorised kernels
    assert caps[-1] == torch.backends.cpu.get_cpu_capability().lower()
    assert caps == [c for c in CPU_CAPABILITIES if c in caps]  # lowest first, each once


def test_merge_floor_grows_with_the_merges():
    eps = torch.finfo(torch.float32).eps
    assert merge_floor(torch.float32, 3.0, 1) == 2 * eps * 3.0  # one part: the backward formula's 2 ulps
    floors = [merge_floor(torch.float32, 3.0, p) for p in (1, 2, 4)]
    assert floors[1] == 2 * floors[0] and floors[2] == 4 * floors[0]  # and 2 more for each merge
    assert merge_floor(torch.float64, 3.0, 4) < 1e-14
    assert merge_floor(torch.bfloat16, 3.0, 4) == 0.0  # its reference error dwarfs any merge
