"""Hypothesis strategies and checks of the fuzz suite (tests/test_fuzz*.py): random calls of every public
argument of :func:`multihead.attention`, each checked against :func:`multihead.attention_reference` in float64.

Dimensions: B batch, H heads, Hkv kv heads, G = H // Hkv, Lq/Lk lengths, Dk/Dv head dims.

Two profiles: ``multihead-fuzz`` (the default: a fixed seed, few examples, what ``make test`` runs) and
``multihead-fuzz-long`` (``MULTIHEAD_FUZZ=long``, what ``make fuzz`` runs: random seeds, many examples).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask

import multihead as mh
from multihead.core import backends
from multihead.core.attention import reference_with
from multihead.core.options import AttentionOptions

LONG = os.environ.get("MULTIHEAD_FUZZ") == "long"
DEVICE = torch.device(os.environ.get("MULTIHEAD_FUZZ_DEVICE", "cpu"))  # a GPU run: MULTIHEAD_FUZZ_DEVICE=cuda
LONG_FACTOR = 25  # examples of the long run per example of the fixed-seed one
for _name, _fixed in (("multihead-fuzz", True), ("multihead-fuzz-long", False)):  # fixed seeds / random ones
    settings.register_profile(
        _name, derandomize=_fixed, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
PROFILE = settings.get_profile("multihead-fuzz-long" if LONG else "multihead-fuzz")
BACKENDS = ("auto", *backends.available())
HANG_S = 60  # one example longer than this is a hang


def fuzz(examples: int) -> settings:
    """The suite's settings for a property: ``examples`` fixed-seed examples, or LONG_FACTOR times as many
    random ones in the long run."""
    return settings(PROFILE, max_examples=examples * LONG_FACTOR if LONG else examples)


@contextlib.contextmanager
def no_hang(seconds: int = HANG_S) -> Iterator[None]:
    """Fail (TimeoutError) when the block runs longer than ``seconds`` (main thread, Unix)."""

    def stop(*_: object) -> None:
        raise TimeoutError(f"one fuzz example ran over {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-6, equal_nan=True, msg=lambda m: f"{what}: {m}")


def names_the_argument(error: Exception, name: str) -> bool:
    """Whether an error's message names ``name`` as a word."""
    return re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", str(error)) is not None


# ------------------------------------------------------------------------------------------------
# Shapes and layouts
# ------------------------------------------------------------------------------------------------


@dataclass
class Shape:
    b: int
    h: int
    hkv: int
    lq: int
    lk: int
    dk: int
    dv: int

    @property
    def target(self) -> tuple[int, int, int, int]:
        return (self.b, self.h, self.lq, self.lk)


@st.composite
def shapes(draw: st.DrawFn, *, most: int = 9) -> Shape:
    hkv, g = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    size = st.integers(0, most)
    dk, dv = draw(st.sampled_from([0, 1, 2, 3, 5, 8])), draw(st.sampled_from([0, 1, 3, 8]))
    return Shape(draw(st.integers(0, 3)), hkv * g, hkv, draw(size), draw(size), dk, dv)


def laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t`` (B, H, L, D) with the same values in another memory layout: ``strided`` (a (B, L, H, D) tensor
    seen through a transpose, as a module's heads), ``expanded`` (stride 0 over the batch where every batch
    row is the first one's: only for tensors built so), or as it is."""
    if layout == "strided":
        return t.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, L, D), strides of (B, L, H, D)
    if layout == "expanded" and t.shape[0] > 0:
        return t[:1].expand_as(t)  # (B, H, L, D), batch stride 0
    return t


def qkv(shape: Shape, seed: int, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, H, Lq, Dk), k (B, Hkv, Lk, Dk), v (B, Hkv, Lk, Dv) float64 leaves in ``layout``."""
    g = torch.Generator().manual_seed(seed)
    s = shape
    out = []
    for dims in ((s.b, s.h, s.lq, s.dk), (s.b, s.hkv, s.lk, s.dk), (s.b, s.hkv, s.lk, s.dv)):
        t = torch.randn(dims, generator=g, dtype=torch.float64).to(DEVICE)
        if layout == "expanded" and s.b > 0:
            t = t[:1].repeat(s.b, 1, 1, 1)  # equal rows, so the stride-0 view holds the same values
        out.append(laid_out(t, layout).requires_grad_(True))
    return out[0], out[1], out[2]


# ------------------------------------------------------------------------------------------------
# Every mask kind
# ------------------------------------------------------------------------------------------------


def _broadcast_shape(draw: st.DrawFn, target: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts to ``target`` (B, H, Lq, Lk): each dim full or 1, leading ones maybe dropped."""
    dims = tuple(n if draw(st.booleans()) else 1 for n in target)
    drop = draw(st.integers(0, 2)) if dims[0] == 1 and dims[1] == 1 else 0
    return dims[drop:]


def _mask_fns(shape: Shape, g: torch.Generator) -> dict[str, object]:
    lq, lk = shape.lq, shape.lk
    table = (torch.rand(shape.b, 1, lq, lk, generator=g) > 0.4).to(DEVICE)
    return {
        "causal_fn": mh.masks.causal_fn(lq, lk),
        "window_fn": mh.masks.sliding_window_fn(2, lq=lq, lk=lk),
        "two_sided_window_fn": mh.masks.sliding_window_fn(2, causal=False, lq=lq, lk=lk),
        "chunked_fn": mh.masks.chunked_fn(3, lq=lq, lk=lk),
        "prefix_lm_fn": mh.masks.prefix_lm_fn(2, lq=lq, lk=lk),
        "lambda_ij": lambda b, h, i, j: (i + j) % 3 != 0,
        "lambda_bh": lambda b, h, i, j: (h % 2 == 0) | (j < 2 + b),
        "tensor_fn": mh.masks.tensor_fn(table),
    }


def _bias_fns(shape: Shape, g: torch.Generator) -> dict[str, object]:
    lq, lk = shape.lq, shape.lk
    table = torch.randn(shape.h, 5, generator=g, dtype=torch.float64).to(DEVICE)
    return {
        "alibi_fn": mh.masks.alibi_fn(shape.h, lq=lq, lk=lk),
        "relative_fn": mh.masks.relative_position_fn(table, lq=lq, lk=lk),
        "lambda_bias": lambda b, h, i, j: (i - j).double() * 0.25 + h,
        # a score_mod as FlexAttention users write one that masks: -inf for the pairs it forbids
        "masking_bias": lambda b, h, i, j: torch.where(
            (i - j).abs() > 2, float("-inf"), (i - j).double() * 0.1
        ),
        "tensor_fn": mh.masks.tensor_fn(
            torch.randn(1, shape.h, lq, lk, generator=g, dtype=torch.float64).to(DEVICE)
        ),
    }


@dataclass
class Case:
    """One valid call: its shape, layout, keywords (the masks), the backend, and the garbage to hide."""

    shape: Shape
    seed: int
    layout: str
    kwargs: dict = field(default_factory=dict)
    backend: str = "auto"
    garbage: float | None = None

    def describe(self) -> str:
        kinds = {k: (type(v).__name__ if isinstance(v, torch.Tensor) else v) for k, v in self.kwargs.items()}
        return f"{self.shape} {self.layout} backend={self.backend} garbage={self.garbage} {kinds}"


@st.composite
def masks(draw: st.DrawFn, shape: Shape, g: torch.Generator, *, functions: bool = True) -> dict:
    """Random attention keywords for ``shape``: any combination of every mask kind and option."""
    s, kw = shape, {}
    kinds = ["none", "bool", "fn", "fn", "block_mask"] if functions else ["none", "bool"]
    mask_kind = draw(st.sampled_from(kinds))
    if mask_kind == "block_mask" and s.b and s.lq and s.lk:  # FlexAttention's own, as its users hold it
        fn = _mask_fns(s, g)[draw(st.sampled_from(sorted(_mask_fns(s, g))))]
        size = draw(st.sampled_from([2, 4, 128]))
        try:
            kw["mask"] = create_block_mask(fn, s.b, s.h, s.lq, s.lk, device=DEVICE, BLOCK_SIZE=size)
        except Exception:  # torch's create_block_mask refuses some mask_mods (vmap): then the function
            kw["mask"] = fn
    elif mask_kind in ("fn", "block_mask"):
        kw["mask"] = _mask_fns(s, g)[draw(st.sampled_from(sorted(_mask_fns(s, g))))]
    elif mask_kind == "bool":
        keep = draw(st.sampled_from([0.2, 0.6, 0.95]))
        kw["mask"] = torch.rand(_broadcast_shape(draw, s.target), generator=g) < keep
    bias_kind = draw(st.sampled_from(["none", "tensor", "fn"] if functions else ["none", "tensor"]))
    if bias_kind == "tensor":
        bias = torch.randn(_broadcast_shape(draw, s.target), generator=g, dtype=torch.float64)
        if draw(st.booleans()):
            bias = bias.masked_fill(torch.rand(bias.shape, generator=g) < 0.3, float("-inf"))
        kw["bias"] = bias.requires_grad_(draw(st.booleans()))
    elif bias_kind == "fn":
        kw["bias"] = _bias_fns(s, g)[draw(st.sampled_from(sorted(_bias_fns(s, g))))]
    vl = draw(st.sampled_from(["none", "b", "b_lq"]))
    if vl == "b":
        kw["valid_lens"] = torch.randint(0, s.lk + 1, (s.b,), generator=g)
    elif vl == "b_lq":
        kw["valid_lens"] = torch.randint(0, s.lk + 1, (s.b, s.lq), generator=g)
    if draw(st.booleans()):
        kw["causal"] = True
    if functions and draw(st.integers(0, 3)) == 0:
        ids = torch.randint(-1, 3, (s.b, max(s.lq, s.lk)), generator=g)
        if draw(st.booleans()):
            ids = ids.sort(dim=1).values  # packed: one run per id
        q_ids, kv_ids = ids[:, ids.shape[1] - s.lq :], ids[:, ids.shape[1] - s.lk :]
        kw["segment_ids"] = q_ids if s.lq == s.lk and draw(st.booleans()) else (q_ids, kv_ids)
    if draw(st.integers(0, 3)) == 0:
        kw["softcap"] = draw(st.sampled_from([0.5, 3.0, 50.0]))
    if draw(st.integers(0, 3)) == 0:
        sinks = torch.randn(s.h, generator=g, dtype=torch.float64)  # (H,)
        spread = draw(st.sampled_from(["randn", "some heads without (-inf)", "large"]))
        if spread == "large":  # a sink far above or below every score
            sinks = sinks * 1e3
        elif spread != "randn":
            sinks = sinks.masked_fill(torch.rand(s.h, generator=g) < 0.5, float("-inf"))
        kw["sinks"] = sinks.requires_grad_(True)
    if draw(st.integers(0, 2)) == 0:
        kw["scale"] = draw(st.sampled_from([-1.0, -0.5, 0.0, 0.3, 2.0, 1, 30.0, -30.0]))  # 30: near one-hot
    if draw(st.integers(0, 3)) == 0:
        kw["dropout"] = draw(st.sampled_from([0.0, 0]))
    if draw(st.integers(0, 3)) == 0:
        kw["return_weights"] = True
    return kw


@st.composite
def cases(draw: st.DrawFn, *, most: int = 9) -> Case:
    shape = draw(shapes(most=most))
    seed = draw(st.integers(0, 2**31 - 1))
    garbage = draw(st.sampled_from([None, None, float("nan"), float("inf"), float("-inf"), 3e38]))
    garbage = garbage if DEVICE.type == "cpu" else None  # on a GPU hidden keys must be finite (docs/masks.md)
    layout = (
        "contiguous" if garbage is not None else draw(st.sampled_from(["contiguous", "strided", "expanded"]))
    )
    g = torch.Generator().manual_seed(seed + 1)
    return Case(
        shape, seed, layout, on_device(draw(masks(shape, g))), draw(st.sampled_from(BACKENDS)), garbage
    )


def on_device(kwargs: dict) -> dict:
    """Attention keywords with every tensor on :data:`DEVICE` (leaves that require grad stay leaves)."""

    def move(x: object) -> object:
        if isinstance(x, tuple):
            return tuple(move(t) for t in x)
        if not isinstance(x, torch.Tensor) or x.device == DEVICE:
            return x
        return x.detach().to(DEVICE).requires_grad_(x.requires_grad)

    return {name: move(x) for name, x in kwargs.items()}


# ------------------------------------------------------------------------------------------------
# What the masks hide: the keys no query of their row and kv head may see, the queries with no key
# ------------------------------------------------------------------------------------------------


def allowed_grid(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """(B, H, Lq, Lk) bool: the (query, key) pairs the masks allow, from the reference's scores (``-inf``
    exactly where a mask forbids; q, k, v finite)."""
    seen = {}

    def visit(point: str, t: torch.Tensor) -> torch.Tensor:
        seen[point] = t
        return t

    with torch.no_grad():
        reference_with(q.detach(), k.detach(), v.detach(), AttentionOptions.of(**kwargs), visit)
    return seen["scores"] != float("-inf")


def with_garbage(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, garbage: float
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
    """q, k, v (new leaves) with ``garbage`` in every hidden key and value (hidden from every query of the
    kv head's G query heads) and in the queries with no allowed key; and those masks ((B, Hkv, Lk, 1),
    (B, H, Lq, 1))."""
    b, h, lq, lk = allowed.shape
    hkv = k.shape[1]
    hidden = ~allowed.any(dim=2).view(b, hkv, h // hkv, lk).any(dim=2).unsqueeze(-1)  # (B, Hkv, Lk, 1)
    dead = ~allowed.any(dim=-1, keepdim=True)  # (B, H, Lq, 1)
    dirty = (
        q.detach().masked_fill(dead, garbage),
        k.detach().masked_fill(hidden, garbage),
        v.detach().masked_fill(hidden, -garbage),
    )
    return tuple(t.requires_grad_(True) for t in dirty), hidden, dead
