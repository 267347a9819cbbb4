"""The tools that keep the numerics honest on every CPU: the capabilities probe and the merge floor."""

import os
import platform
from pathlib import Path

import pytest
import torch

from multihead.testing import CPU_CAPABILITIES, cpu_capabilities, merge_floor


@pytest.fixture(scope="module")
def probed() -> list[str]:
    """One run of the probe over every capability (each child imports torch: seconds)."""
    return cpu_capabilities()


@pytest.mark.skipif("ATEN_CPU_CAPABILITY" in os.environ, reason="probes torch's own pick, unset here")
def test_capabilities_probe_ends_with_torchs_own_pick(probed):
    caps = probed
    assert caps[0] == "default"  # every CPU runs the unvectorised kernels
    assert caps[-1] == torch.backends.cpu.get_cpu_capability().lower().replace("no avx", "default")
    assert caps == [c for c in CPU_CAPABILITIES if c in caps]  # lowest first, each once


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(
    platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists(),
    reason="x86 Linux: reads the CPU's flags",
)
def test_capabilities_probe_agrees_with_the_cpus_own_flags(probed):
    """torch 2.13 takes and *reports* avx512 on a CPU without it (then dies of SIGILL in its first kernel):
    the probe keeps avx512 only where the CPU has AVX-512 (F, BW, VL, DQ: what torch's kernels use), avx2
    only with AVX2 and FMA."""
    flags = _cpu_flags()
    caps = probed
    assert ("avx512" in caps) == ({"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags)
    assert ("avx2" in caps) == ({"avx2", "fma"} <= flags)


@pytest.mark.parametrize(
    "child",
    [
        "import os, signal; print('default', flush=True); os.kill(os.getpid(), signal.SIGILL)",  # dies in a kernel
        "print('default'); print('wrong')",  # kernels ran but computed garbage
        "print('avx2'); print('ran')",  # torch fell back to another capability
        "raise SystemExit(3)",  # torch failed to import
    ],
)
def test_capabilities_probe_leaves_out_a_capability_whose_child_fails(child):
    """A child that dies of an illegal instruction (what avx512 does on an AVX2-only CPU), or reports another
    capability, or fails: that capability is left out, and the caller goes on."""
    assert cpu_capabilities(("default",), probe=child) == []


def test_merge_floor_grows_with_the_merges():
    eps = torch.finfo(torch.float32).eps
    assert merge_floor(torch.float32, 3.0, 1) == 2 * eps * 3.0  # one part: the backward formula's 2 ulps
    floors = [merge_floor(torch.float32, 3.0, p) for p in (1, 2, 4)]
    assert floors[1] == 2 * floors[0] and floors[2] == 4 * floors[0]  # and 2 more for each merge
    assert merge_floor(torch.float64, 3.0, 4) < 1e-14
    assert merge_floor(torch.bfloat16, 3.0, 4) == 0.0  # its reference error dwarfs any merge
