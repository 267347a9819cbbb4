"""The fuzzed contract of :func:`multihead.attention` on invalid calls (issue 46): a valid random call with one
argument spoiled raises a ValueError or TypeError whose message names that argument -- never another error,
never a hang -- on every backend and in :func:`multihead.attention_reference`.

Dimensions: B batch, H heads, Hkv kv heads, Lq/Lk lengths, Dk/Dv head dims.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from fuzz_cases import BACKENDS, Shape, fuzz, masks, names_the_argument, no_hang, shapes
from hypothesis import given
from hypothesis import strategies as st

import multihead as mh

Spoil = Callable[[Shape, tuple], dict]


def _qkv(s: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.randn(s.b, s.h, s.lq, s.dk),
        torch.randn(s.b, s.hkv, s.lk, s.dk),
        torch.randn(s.b, s.hkv, s.lk, s.dv),
    )


def _resized(t: torch.Tensor, dim: int, by: int = 1) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] += by
    return torch.zeros(shape, dtype=t.dtype)


def _flag_spoils(name: str) -> list[tuple[str, Spoil]]:
    bad = ["False", "no", 0.5, [1], 2, None, torch.tensor(True), -1]
    return [(name, lambda s, t, x=x: {name: x}) for x in bad]


SPOILS: list[tuple[str, Spoil]] = [
    ("q", lambda s, t: {"q": t[0].flatten(0, 1)}),  # 3-D
    ("q", lambda s, t: {"q": t[0].long()}),
    ("q", lambda s, t: {"q": t[0].tolist()}),
    ("k", lambda s, t: {"k": t[1].float()[..., None]}),  # 5-D
    ("k", lambda s, t: {"k": _resized(t[1], 3)}),  # Dk
    ("k", lambda s, t: {"k": _resized(t[1], 0)}),  # B
    ("k", lambda s, t: {"k": _resized(t[1], 1, s.h)}),  # H % Hkv
    ("k", lambda s, t: {"k": t[1].to(torch.float64)}),
    ("v", lambda s, t: {"v": _resized(t[2], 2)}),  # Lk
    ("v", lambda s, t: {"v": "v"}),
    ("mask", lambda s, t: {"mask": torch.ones(s.lq, s.lk, dtype=torch.int64)}),
    ("mask", lambda s, t: {"mask": torch.zeros(s.lq, s.lk)}),
    ("mask", lambda s, t: {"mask": torch.ones(s.lq + 1, s.lk + 2, dtype=torch.bool)}),
    ("mask", lambda s, t: {"mask": [[True]]}),
    ("mask", lambda s, t: {"mask": torch.ones(s.lq, s.lk, dtype=torch.bool, device="meta")}),
    ("mask", lambda s, t: {"mask": lambda b, h, i, j: (i - j).float()}),  # not bool
    ("mask", lambda s, t: {"mask": lambda i, j: i >= j}),  # two indices
    ("mask", lambda s, t: {"mask": lambda b, h, i, j: 1 / 0}),  # raises
    ("bias", lambda s, t: {"bias": torch.ones(s.lq, s.lk, dtype=torch.int64)}),
    ("bias", lambda s, t: {"bias": torch.zeros(s.h + 1, s.lq + 1, s.lk + 1)}),
    ("bias", lambda s, t: {"bias": "alibi"}),
    ("bias", lambda s, t: {"bias": lambda score, b, h, i, j: score}),  # a score_mod
    ("bias", lambda s, t: {"bias": torch.zeros(s.lq, s.lk, device="meta")}),
    ("valid_lens", lambda s, t: {"valid_lens": torch.ones(s.b, dtype=torch.float32)}),
    ("valid_lens", lambda s, t: {"valid_lens": torch.ones(s.b + 1, dtype=torch.long)}),
    ("valid_lens", lambda s, t: {"valid_lens": torch.ones(s.b, s.lq + 1, dtype=torch.long)}),
    ("valid_lens", lambda s, t: {"valid_lens": torch.ones(s.b, s.lq, 1, dtype=torch.long)}),
    ("valid_lens", lambda s, t: {"valid_lens": -torch.ones(max(s.b, 1), dtype=torch.long)}),
    ("valid_lens", lambda s, t: {"valid_lens": [1] * s.b}),
    *_flag_spoils("causal"),
    *_flag_spoils("return_weights"),
    ("segment_ids", lambda s, t: {"segment_ids": torch.zeros(s.b, s.lq)}),
    ("segment_ids", lambda s, t: {"segment_ids": torch.zeros(s.b + 1, s.lq, dtype=torch.long)}),
    ("segment_ids", lambda s, t: {"segment_ids": (torch.zeros(s.b, s.lq, dtype=torch.long),) * 3}),
    ("segment_ids", lambda s, t: {"segment_ids": (torch.zeros(s.b, s.lq + 1, dtype=torch.long),) * 2}),
    ("segment_ids", lambda s, t: {"segment_ids": [[0] * s.lq] * s.b}),
    ("softcap", lambda s, t: {"softcap": 0.0}),
    ("softcap", lambda s, t: {"softcap": -2.0}),
    ("softcap", lambda s, t: {"softcap": float("nan")}),
    ("softcap", lambda s, t: {"softcap": float("inf")}),
    ("softcap", lambda s, t: {"softcap": "1"}),
    ("softcap", lambda s, t: {"softcap": True}),
    ("sinks", lambda s, t: {"sinks": torch.zeros(s.h + 1)}),
    ("sinks", lambda s, t: {"sinks": torch.zeros(s.h, dtype=torch.long)}),
    ("sinks", lambda s, t: {"sinks": [0.0] * s.h}),
    ("sinks", lambda s, t: {"sinks": torch.zeros(s.h, device="meta")}),
    ("scale", lambda s, t: {"scale": float("nan")}),
    ("scale", lambda s, t: {"scale": float("inf")}),
    ("scale", lambda s, t: {"scale": "0.5"}),
    ("scale", lambda s, t: {"scale": True}),
    ("scale", lambda s, t: {"scale": torch.tensor(0.5)}),
    ("dropout", lambda s, t: {"dropout": -0.1}),
    ("dropout", lambda s, t: {"dropout": 1.0}),
    ("dropout", lambda s, t: {"dropout": float("nan")}),
    ("dropout", lambda s, t: {"dropout": "0"}),
    ("dropout", lambda s, t: {"dropout": True}),
    ("backend", lambda s, t: {"backend": "nope"}),
    ("backend", lambda s, t: {"backend": 3}),
]
REFERENCE_LACKS = {"backend"}


def _spoiled(s: Shape, kw: dict, name: str, spoil: Spoil) -> dict:
    """The valid keywords with one argument spoiled (a pair of one-id segment ids for Lq != Lk, where one
    tensor alone is already wrong)."""
    t = _qkv(s)
    out = {"q": t[0], "k": t[1], "v": t[2], **kw, **spoil(s, t)}
    if (
        name != "segment_ids"
        and "segment_ids" in out
        and s.lq != s.lk
        and not isinstance(out["segment_ids"], tuple)
    ):
        del out["segment_ids"]
    return out


@fuzz(100)
@given(st.data())
def test_a_spoiled_argument_is_named(data):
    name, spoil = data.draw(st.sampled_from(SPOILS))
    s = data.draw(shapes())
    if callable(spoil(s, _qkv(s)).get(name)) and 0 in s.target:
        s.lq, s.lk, s.b = s.lq or 1, s.lk or 1, s.b or 1  # a function is checked where it is called: a grid
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    kw = data.draw(masks(s, g))
    kw = {
        k: (v.detach().float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in kw.items()
    }
    args = _spoiled(s, kw, name, spoil)
    backend = args.pop("backend", data.draw(st.sampled_from(BACKENDS)))
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    calls = [("attention", lambda: mh.attention(q, k, v, backend=backend, **args))]
    if name not in REFERENCE_LACKS:
        calls.append(("attention_reference", lambda: mh.attention_reference(q, k, v, **args)))
    for fn_name, call in calls:
        with no_hang(), pytest.raises((ValueError, TypeError)) as info:
            call()
        assert names_the_argument(info.value, name), f"{fn_name} with a bad {name}: {info.value!r}"
