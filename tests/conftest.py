"""Fixtures shared by several test modules."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread per xdist worker: tests of many tiny ops would otherwise oversubscribe the cores.

    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
