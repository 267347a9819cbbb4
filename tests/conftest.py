"""Fixtures shared by several test modules, and how the suite is laid out on xdist workers."""

import os

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    """Under ``pytest -n N`` with N workers for N cores or fewer, each worker computes on one thread:
    two workers of two threads each on two cores spend their time waiting on each other's threads."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers and workers >= (os.cpu_count() or 1):
        torch.set_num_threads(1)
    asked = os.environ.get("ATEN_CPU_CAPABILITY")
    took = torch.backends.cpu.get_cpu_capability().lower().replace("no avx", "default")
    if asked and asked.lower() != took:  # tests/cpu_kernels.py's reruns would check another kernel than named
        raise pytest.UsageError(
            f"ATEN_CPU_CAPABILITY={asked}, but torch runs its {took} kernels: this CPU lacks {asked}; unset "
            "the variable or pick one that `multihead.testing.cpu_capabilities()` lists"
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failure under ``ATEN_CPU_CAPABILITY`` (tests/cpu_kernels.py: one xdist worker per capability) says
    which kernels it ran on."""
    report = yield
    if report.failed and "ATEN_CPU_CAPABILITY" in os.environ:
        report.sections.append(("CPU kernels", f"ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']}"))
    return report


@pytest.fixture
def one_thread():
    """One intra-op thread per xdist worker: tests of many tiny ops would otherwise oversubscribe the cores.

    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# The tests that each run Keras on one backend in a fresh Python process: about 40% of the suite's CPU time in
# six tests (seconds measured on the 2-core machine). `make test` runs `pytest -n 2 --dist worksteal`, which
# hands each worker one contiguous half of the collection; these go first in each half, alternately by cost,
# so both workers start on them at once and the many short tests fill in around them, instead of one worker
# meeting them late and finishing alone.
SUBPROCESS_HEAVY = {
    "tests/test_keras_upstream.py::test_keras_own_mha_tests_pass_on_our_layer[jax]": 72,
    "tests/test_compat_keras_env.py::test_keras_tests_pass_on_the_other_backends[jax]": 61,
    "tests/test_keras_upstream.py::test_keras_own_mha_tests_pass_on_our_layer[tensorflow]": 33,
    "tests/test_compat_keras_env.py::test_keras_tests_pass_on_the_other_backends[tensorflow]": 31,
    "tests/test_keras_upstream.py::test_keras_own_mha_tests_pass_on_our_layer[torch]": 24,
    "tests/test_compat_keras_env.py::test_keras_layer_imports_and_runs_without_torch_on_jax": 10,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    heavy = sorted(
        (it for it in items if it.nodeid in SUBPROCESS_HEAVY), key=lambda it: -SUBPROCESS_HEAVY[it.nodeid]
    )
    if not heavy:
        return
    rest = [it for it in items if it.nodeid not in SUBPROCESS_HEAVY]
    first, second = heavy[0::2], heavy[1::2]
    cut = max(0, len(items) // 2 - len(first))  # the second half starts at len(items) // 2
    items[:] = first + rest[:cut] + second + rest[cut:]


@pytest.fixture
def registry():
    """The backend registry and auto order restored after the test, whatever it registered."""
    from multihead.core import backends

    saved, order = dict(backends._REGISTRY), list(backends.AUTO_ORDER)
    yield backends
    backends._REGISTRY.clear()
    backends._REGISTRY.update(saved)
    backends.AUTO_ORDER[:] = order
    backends._CHANGES[0] += 1  # the unmasked route is looked up again
