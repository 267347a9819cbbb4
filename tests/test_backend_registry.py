"""The backend registry: where a backend goes in the auto order, re-registration, refusals.

Dimensions: B batch, H heads, L length, D head dim.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.core import backends
from multihead.core.attention import prepare


class _Echo:
    """A user backend: serves calls with a dense mask (after sdpa would, before math); output = q."""

    def __init__(self, name="echo", serves=True):
        self.name, self.serves, self.calls = name, serves, 0

    def why_not(self, call):
        if not self.serves:
            yield f"{self.name} is switched off"
        if not call.return_weights:
            yield f"{self.name} serves only return_weights=True"

    def __call__(self, call):
        self.calls += 1
        b, h, lq, _ = call.q.shape
        return call.q, call.q.new_zeros(b, h, lq, call.k.shape[2])


def _qkv():
    return (torch.randn(1, 2, 4, 8) for _ in range(3))  # (B, H, L, D)


def test_a_user_backend_before_math_is_picked_by_auto(registry):
    echo = registry.register(_Echo(), before="math")
    assert registry.AUTO_ORDER.index("echo") == registry.AUTO_ORDER.index("math") - 1
    q, k, v = _qkv()
    out, weights = mh.attention(q, k, v, return_weights=True)  # sdpa refuses weights; echo comes first
    assert echo.calls == 1 and out is q and weights.abs().max() == 0
    mh.attention(q, k, v)  # sdpa serves this one, ahead of echo
    assert echo.calls == 1


def test_appended_by_default_and_after(registry):
    registry.register(_Echo("last"))
    assert registry.AUTO_ORDER[-1] == "last"
    registry.register(_Echo("second"), after=registry.AUTO_ORDER[0])
    assert registry.AUTO_ORDER[1] == "second"


def test_unknown_or_own_anchor_raises_naming_the_order(registry):
    with pytest.raises(ValueError, match=r"before='nope' must name another backend of the auto order \["):
        registry.register(_Echo(), before="nope")
    with pytest.raises(ValueError, match="after='math'.*auto order"):
        registry.register(_Echo("math"), after="math")
    with pytest.raises(ValueError, match="not both"):
        registry.register(_Echo(), before="math", after="sdpa")
    with pytest.raises(ValueError, match="need auto=True"):
        registry.register(_Echo(), auto=False, before="math")
    assert "echo" not in registry.available()  # nothing half-registered


def test_a_backend_needs_a_name_why_not_and_call(registry):
    with pytest.raises(ValueError, match="`name` str other than 'auto'"):
        registry.register(_Echo("auto"))
    with pytest.raises(TypeError, match="why_not"):
        registry.register(type("NoWhy", (), {"name": "x", "__call__": lambda self, c: None})())


def test_registering_again_replaces_and_keeps_or_moves_the_place(registry):
    first = registry.register(_Echo(), before="math")
    place = registry.AUTO_ORDER.index("echo")
    again = registry.register(_Echo(serves=False))  # same name: replaced, same place
    assert registry.get("echo") is again is not first and registry.AUTO_ORDER.index("echo") == place
    assert registry.AUTO_ORDER.count("echo") == 1
    registry.register(_Echo(), before=registry.AUTO_ORDER[0])  # moved to the front
    assert registry.AUTO_ORDER[0] == "echo" and registry.AUTO_ORDER.count("echo") == 1
    registry.register(_Echo(), auto=False)  # registered, but out of the auto order
    assert "echo" in registry.available() and "echo" not in registry.AUTO_ORDER


def test_unregister(registry):
    registry.register(_Echo(), before="math")
    assert registry.unregister("echo").name == "echo"
    assert "echo" not in registry.available() and "echo" not in registry.AUTO_ORDER
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        registry.unregister("echo")


def test_a_refusing_user_backend_is_skipped(registry):
    echo = registry.register(_Echo(serves=False), before="math")
    q, k, v = _qkv()
    mh.attention(q, k, v, return_weights=True)  # math serves
    assert echo.calls == 0
    assert "echo is switched off" in mh.core.explain_backends(q, k, v)["echo"][0]


class _Deferring(_Echo):
    """A backend that serves every weights call but defers it to ``to`` (auto routing only)."""

    def __init__(self, name, to):
        super().__init__(name)
        self.to = to

    def defers(self, call):
        return backends.Deferral(self.to, f"{self.to} serves it for less")


@pytest.mark.parametrize("target_serves", [True, False])
def test_a_deferral_goes_to_the_named_backend_only_when_it_can_serve(registry, target_serves):
    first = registry.register(_Deferring("first", to="second"), before="math")
    second = registry.register(_Echo("second", serves=target_serves), auto=False)  # not in the auto order
    q, k, v = _qkv()
    mh.attention(q, k, v, return_weights=True)
    assert (second.calls, first.calls) == ((1, 0) if target_serves else (0, 1))
    mh.attention(q, k, v, return_weights=True, backend="first")  # named: served, no deferral
    assert first.calls == (1 if target_serves else 2)


def test_sdpa_defers_packed_cpu_batches_to_blocked_and_keeps_what_blocked_cannot_serve():
    ids = torch.tensor([[0] * 8 + [1] * 8 + [2] * 8])
    q, k, v = (torch.randn(1, 2, 24, 8) for _ in range(3))
    call = prepare(q, k, v, segment_ids=ids)
    assert backends.select(call).name == "blocked"
    half = prepare(*(t.half() for t in (q, k, v)), segment_ids=ids)
    assert backends.select(half).name == "sdpa"  # blocked has no float16: sdpa keeps it
