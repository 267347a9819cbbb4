"""The fuzzed contract of :func:`multihead.attention` (issue 46): every backend agrees with the float64
reference -- values and gradients -- or refuses by name, on random valid calls of every argument; what the
masks hide never reaches an output or a gradient, whatever it holds; random invalid calls raise a
ValueError or TypeError naming the argument.

Dimensions: B batch, H heads, Hkv kv heads, Lq/Lk lengths, Dk/Dv head dims.
``make fuzz`` runs these (and tests/test_fuzz_*.py) with many random examples (tests/fuzz_cases.py).
"""

from __future__ import annotations

import pytest
import torch
from fuzz_cases import DEVICE, Case, allowed_grid, cases, close, fuzz, no_hang, qkv, with_garbage
from hypothesis import given
from hypothesis import strategies as st

import multihead as mh
from multihead.core.options import output_and_weights

pytestmark = pytest.mark.numerics


def _leaves(*ts: object) -> list[torch.Tensor]:
    return [t for t in ts if isinstance(t, torch.Tensor) and t.requires_grad]


def _grads(res: object, leaves: list[torch.Tensor], seed: int) -> list[torch.Tensor | None]:
    """Gradients of a fixed random projection of the output (and weights) with respect to ``leaves``."""
    out, weights = output_and_weights(res)
    g = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype).to(out.device)).sum()
    if weights is not None:
        noise = torch.randn(weights.shape, generator=g, dtype=weights.dtype).to(weights.device)
        loss = loss + (weights * noise).sum()
    if not loss.requires_grad:
        return [None] * len(leaves)
    return list(torch.autograd.grad(loss, leaves, allow_unused=True))


def check_case(case: Case) -> None:
    """The call on its backend against the reference on clean inputs: output, weights and gradients."""
    q, k, v = qkv(case.shape, case.seed, case.layout)
    kw = case.kwargs
    inputs = (q, k, v)
    if case.garbage is not None:
        inputs, _, _ = with_garbage(q, k, v, allowed_grid(q, k, v, kw), case.garbage)
    with no_hang():
        want = mh.attention_reference(q, k, v, **kw)
        try:
            got = mh.attention(*inputs, backend=case.backend, **kw)
        except ValueError as e:  # a named backend may refuse, by name; auto never does
            assert case.backend != "auto" and f"backend {case.backend!r} cannot serve" in str(e), (
                case.describe()
            )
            return
        extras = [kw.get("sinks"), kw.get("bias")]
        got_grads = _grads(got, _leaves(*inputs, *extras), case.seed)
        want_grads = _grads(want, _leaves(q, k, v, *extras), case.seed)
    (out, weights), (want_out, want_weights) = output_and_weights(got), output_and_weights(want)
    close(out, want_out, f"output of {case.describe()}")
    if want_weights is not None:
        close(weights, want_weights, f"weights of {case.describe()}")
    for i, (a, b) in enumerate(zip(got_grads, want_grads, strict=True)):
        if a is None or b is None:
            assert (a is None or not a.any()) and (b is None or not b.any()), (
                f"gradient {i} of {case.describe()}"
            )
        else:
            close(a, b, f"gradient {i} of {case.describe()}")


@fuzz(80)
@given(cases())
def test_every_backend_agrees_with_the_reference_or_refuses_by_name(case):
    check_case(case)


@fuzz(15)
@given(cases(most=40))
def test_longer_rows_cross_the_backends_tiles(case):
    check_case(case)


@fuzz(25)
@given(st.data())
def test_hidden_garbage_reaches_nothing(data):
    case = data.draw(cases())
    case.garbage = (
        data.draw(st.sampled_from([float("nan"), float("inf"), 3e38])) if DEVICE.type == "cpu" else None
    )
    case.layout = "contiguous"
    check_case(case)
