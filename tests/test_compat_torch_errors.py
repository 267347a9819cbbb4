"""Issue 55, item 2: every error of the torch drop-in is also of the class ``torch.nn.MultiheadAttention``
raises for the same mistake, so an ``except`` clause written for torch catches it.

Each bad call goes to torch's own module (torch 2.13 here) and to the drop-in holding the same weights; the
drop-in's error must be an instance of the class torch raised, a ``ValueError`` or ``TypeError`` as the
library's errors are, and name the argument. Case by case, in torch's general path (training) and its fused
inference path (eval, no grad, batch_first self-attention), then inside ``nn.TransformerEncoderLayer`` and
``nn.TransformerDecoderLayer`` after :func:`~multihead.compat.torch.convert`, then fuzzed over module flags.

Dimensions: N batch, L target length, S source length, E embed_dim, H heads.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import pytest
import torch
from fuzz_cases import fuzz, names_the_argument
from hypothesis import assume, given
from hypothesis import strategies as st
from torch import nn

from multihead.compat.torch import (
    FastPathShapeError,
    InputDtypeError,
    IsCausalError,
    MultiheadAttention,
    MultiheadAttentionError,
    MultiheadAttentionRuntimeError,
    NotATensorError,
    convert,
)

E = 8


@dataclass(frozen=True)
class Config:
    """One module and one way of calling it."""

    batch_first: bool = False
    heads: int = 2
    kdim: int | None = None  # None: kdim = vdim = E (one in_proj_weight); else kdim = vdim = this
    add_bias_kv: bool = False
    add_zero_attn: bool = False
    batched: bool = True
    fused: bool = False  # eval and no grad, query is key is value: torch's fused path where its flags allow
    need_weights: bool = True
    n: int = 3
    lq: int = 4
    ls: int = 5

    @property
    def same(self) -> bool:
        """Self-attention with one tensor (as torch's fused path needs; S = L then)."""
        return self.fused and self.kdim is None


def _x(cfg: Config, n: int, length: int, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A query, key or value in the caller's layout: (N, L, e), (L, N, e) or unbatched (L, e)."""
    if not cfg.batched:
        return torch.randn(length, e, dtype=dtype)
    return (
        torch.randn(n, length, e, dtype=dtype) if cfg.batch_first else torch.randn(length, n, e, dtype=dtype)
    )


def _lengths(cfg: Config) -> tuple[int, int]:
    return (cfg.lq, cfg.lq) if cfg.same else (cfg.lq, cfg.ls)


def _call(cfg: Config) -> dict:
    """A valid call of the module ``cfg`` describes."""
    kd = cfg.kdim or E
    query = _x(cfg, cfg.n, cfg.lq, E)
    if cfg.same:
        return {"query": query, "key": query, "value": query}
    return {"query": query, "key": _x(cfg, cfg.n, cfg.ls, kd), "value": _x(cfg, cfg.n, cfg.ls, kd)}


def _inputs(cfg: Config, **changed: torch.Tensor | object) -> dict:
    """query, key and value with ``changed`` ones replaced; under self-attention one changed tensor is all
    three (so the call stays on torch's fused path)."""
    if cfg.same:
        one = next(iter(changed.values()))
        return {"query": one, "key": one, "value": one}
    return {**_call(cfg), **changed}


# Each mistake: the argument it concerns and the call with it; None where it does not apply to the config.
def _attn_mask_2d(c):
    lq, ls = _lengths(c)
    return {**_call(c), "attn_mask": torch.zeros(lq + 1, ls, dtype=torch.bool)}


def _attn_mask_3d(c):
    lq, ls = _lengths(c)
    rows = c.n * c.heads + 1 if c.batched else c.heads + 1
    return {**_call(c), "attn_mask": torch.zeros(rows, lq, ls, dtype=torch.bool)}


def _attn_mask_rank(c, rank):
    lq, ls = _lengths(c)
    return {**_call(c), "attn_mask": torch.zeros((c.n, c.heads, lq, ls)[4 - rank :], dtype=torch.bool)}


def _kpm_shape(c):
    ls = _lengths(c)[1]
    return {
        **_call(c),
        "key_padding_mask": torch.zeros((c.n, ls + 1) if c.batched else (ls + 1,), dtype=torch.bool),
    }


def _kpm_rank(c):
    ls = _lengths(c)[1]
    return {**_call(c), "key_padding_mask": torch.zeros((ls,) if c.batched else (1, ls), dtype=torch.bool)}


def _mask_dtype(c, name, dtype):
    lq, ls = _lengths(c)
    shape = (lq, ls) if name == "attn_mask" else ((c.n, ls) if c.batched else (ls,))
    return {**_call(c), name: torch.zeros(shape, dtype=dtype)}


def _key_batch(c, value_too):
    if not c.batched:
        return None
    kd, ls = c.kdim or E, _lengths(c)[1]
    key = _x(c, c.n + 1, ls, kd)
    return {**_call(c), "key": key, "value": key if value_too else _x(c, c.n, ls, kd)}


def _key_features(c, value_too):
    kd, ls = c.kdim or E, _lengths(c)[1]
    key = _x(c, c.n, ls, kd + 1)
    return {**_call(c), "key": key, "value": key if value_too else _x(c, c.n, ls, kd)}


def _value_length(c):
    lq, ls = _lengths(c)
    return {**_call(c), "value": _x(c, c.n, ls + 1, c.kdim or E)}


def _query_dtype(c, dtype):
    return _inputs(c, query=_x(c, c.n, c.lq, E, torch.float64).to(dtype))


MISTAKES = {
    "attn_mask 2-D shape": ("attn_mask", _attn_mask_2d),
    "attn_mask 3-D shape": ("attn_mask", _attn_mask_3d),
    "attn_mask 1-D": ("attn_mask", lambda c: _attn_mask_rank(c, 1)),
    "attn_mask 4-D": ("attn_mask", lambda c: _attn_mask_rank(c, 4)),
    "attn_mask int64": ("attn_mask", lambda c: _mask_dtype(c, "attn_mask", torch.int64)),
    "attn_mask float64": ("attn_mask", lambda c: _mask_dtype(c, "attn_mask", torch.float64)),
    "attn_mask list": ("attn_mask", lambda c: {**_call(c), "attn_mask": [[0.0] * _lengths(c)[1]] * c.lq}),
    "key_padding_mask shape": ("key_padding_mask", _kpm_shape),
    "key_padding_mask rank": ("key_padding_mask", _kpm_rank),
    "key_padding_mask int64": ("key_padding_mask", lambda c: _mask_dtype(c, "key_padding_mask", torch.int64)),
    "key_padding_mask float16": (
        "key_padding_mask",
        lambda c: _mask_dtype(c, "key_padding_mask", torch.float16),
    ),
    "key_padding_mask list": ("key_padding_mask", lambda c: {**_call(c), "key_padding_mask": [[False]]}),
    "key and value batch": ("key", lambda c: _key_batch(c, True)),
    "key batch": ("key", lambda c: _key_batch(c, False)),
    "key and value features": ("key", lambda c: _key_features(c, True)),
    "key features": ("key", lambda c: _key_features(c, False)),
    "value length": ("value", _value_length),
    "query features": ("query", lambda c: _inputs(c, query=_x(c, c.n, c.lq, E + 1))),
    "query 4-D": ("query", lambda c: _inputs(c, query=torch.randn(1, c.n, c.lq, E))),
    "query 1-D": ("query", lambda c: _inputs(c, query=torch.randn(E))),
    "key rank": ("key", lambda c: {**_call(c), "key": torch.randn(c.lq, c.n, E, 1)}),
    "query float64": ("query", lambda c: _query_dtype(c, torch.float64)),
    "query int64": ("query", lambda c: _query_dtype(c, torch.int64)),
    "query float16": ("query", lambda c: _query_dtype(c, torch.float16)),
    "key float64": ("key", lambda c: {**_call(c), "key": _call(c)["key"].double()}),
    "query list": ("query", lambda c: {**_call(c), "query": _call(c)["query"].tolist()}),
    "query None": ("query", lambda c: {**_call(c), "query": None}),
    "key list": ("key", lambda c: {**_call(c), "key": _call(c)["key"].tolist()}),
    "value list": ("value", lambda c: {**_call(c), "value": _call(c)["value"].tolist()}),
    "is_causal without attn_mask": ("is_causal", lambda c: {**_call(c), "is_causal": True}),
}
# torch's fused path takes these and answers (it drops the hint); the drop-in refuses: test_fused_path_lenience
FUSED_ANSWERS = {"is_causal without attn_mask"}


def _pair(cfg: Config) -> tuple[nn.MultiheadAttention, MultiheadAttention]:
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(
        E, cfg.heads, batch_first=cfg.batch_first, kdim=cfg.kdim, vdim=cfg.kdim,
        add_bias_kv=cfg.add_bias_kv, add_zero_attn=cfg.add_zero_attn,
    )  # fmt: skip
    ref.train(not cfg.fused)
    return ref, MultiheadAttention.from_torch(ref)


def _raised(module: nn.Module, call: dict, cfg: Config) -> Exception | None:
    with torch.set_grad_enabled(not cfg.fused), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            module(**call, need_weights=cfg.need_weights)
        except Exception as e:  # the class is what is compared
            return e
    return None


def _check(cfg: Config, mistake: str) -> None:
    """The same bad call to torch and to the drop-in: the drop-in's error is of torch's class."""
    name, build = MISTAKES[mistake]
    call = build(cfg)
    ref, ours = _pair(cfg)
    theirs, mine = _raised(ref, call, cfg), _raised(ours, call, cfg)
    assert theirs is not None, f"torch takes {mistake!r} under {cfg}: not a mistake there"
    assert mine is not None, f"the drop-in takes {mistake!r} under {cfg}; torch: {theirs!r}"
    assert isinstance(mine, type(theirs)), f"{mistake!r} under {cfg}: torch {theirs!r}, the drop-in {mine!r}"
    assert isinstance(mine, (ValueError, TypeError)), repr(mine)
    assert names_the_argument(mine, name), f"{mistake!r}: {mine}"


MODES = {
    "train": Config(),
    "train, batch_first": Config(batch_first=True),
    "unbatched": Config(batched=False),
    "kdim": Config(kdim=6),
    "fused": Config(batch_first=True, fused=True, need_weights=False),
    "fused, weights": Config(batch_first=True, fused=True),
    "eval, batch second": Config(fused=True),
}


def _applies(mistake: str, cfg: Config) -> bool:
    """Whether the mistake has a meaning under ``cfg`` (no key batch in an unbatched call) and torch refuses it
    there (its fused path answers the ones in FUSED_ANSWERS)."""
    return MISTAKES[mistake][1](cfg) is not None and not (mistake in FUSED_ANSWERS and cfg.fused)


@pytest.mark.parametrize(
    ("mistake", "mode"), [(m, c) for m in sorted(MISTAKES) for c in MODES if _applies(m, MODES[c])]
)
def test_the_drop_in_raises_torchs_class(mistake, mode):
    _check(MODES[mode], mistake)


# The mistakes issue 55 names, with the class a user's `except` clause written for torch names.
ISSUE_55 = {
    "attn_mask 2-D shape": (RuntimeError, MultiheadAttentionRuntimeError),
    "attn_mask 3-D shape": (RuntimeError, MultiheadAttentionRuntimeError),
    "key and value batch": (RuntimeError, MultiheadAttentionRuntimeError),
    "key and value features": (RuntimeError, MultiheadAttentionRuntimeError),
    "query float64": (RuntimeError, InputDtypeError),
    "query int64": (RuntimeError, InputDtypeError),
    "query list": (AttributeError, NotATensorError),
}


@pytest.mark.parametrize("mistake", sorted(ISSUE_55))
def test_except_clauses_written_for_torch_catch_the_drop_ins_errors(mistake):
    torch_class, ours_class = ISSUE_55[mistake]
    cfg = Config()
    call = MISTAKES[mistake][1](cfg)
    ref, ours = _pair(cfg)
    for module in (ref, ours):
        with pytest.raises(torch_class) as caught:
            module(**call)
    assert type(caught.value) is ours_class
    base = TypeError if ours_class in (InputDtypeError, NotATensorError) else ValueError
    assert isinstance(caught.value, base)


def test_the_error_classes_are_both():
    assert issubclass(MultiheadAttentionError, ValueError) and issubclass(
        MultiheadAttentionError, AssertionError
    )
    assert issubclass(MultiheadAttentionRuntimeError, ValueError)
    assert issubclass(MultiheadAttentionRuntimeError, RuntimeError)
    assert not issubclass(MultiheadAttentionRuntimeError, AssertionError)
    assert issubclass(FastPathShapeError, MultiheadAttentionError) and issubclass(
        FastPathShapeError, RuntimeError
    )
    assert issubclass(InputDtypeError, TypeError) and issubclass(InputDtypeError, RuntimeError)
    assert issubclass(NotATensorError, TypeError) and issubclass(NotATensorError, AttributeError)
    assert issubclass(IsCausalError, MultiheadAttentionRuntimeError)


def test_fused_path_lenience():
    """torch's fused inference path drops ``is_causal`` without a mask and answers; the drop-in refuses it
    everywhere, with the error torch's general path raises (documented in docs/compat.md)."""
    cfg = MODES["fused"]
    call = MISTAKES["is_causal without attn_mask"][1](cfg)
    ref, ours = _pair(cfg)
    assert _raised(ref, call, cfg) is None
    assert isinstance(_raised(ours, call, cfg), IsCausalError)
    general = replace(cfg, fused=False)  # the same call in training: torch's general path refuses it
    assert isinstance(_raised(_pair(general)[0], call, general), RuntimeError)


# ---- inside torch's layers, where convert() puts the drop-in -----------------------------------------------

N, L, S = 3, 4, 5


def _seq(batch_first, n=N, length=L, e=E, dtype=torch.float32):
    return torch.randn(n, length, e, dtype=dtype) if batch_first else torch.randn(length, n, e, dtype=dtype)


ENCODER = {
    "src_mask 2-D shape": lambda bf: {"src_mask": torch.zeros(L + 1, L, dtype=torch.bool)},
    "src_mask 3-D shape": lambda bf: {"src_mask": torch.zeros(N, L, L, dtype=torch.bool)},
    "src_mask 4-D": lambda bf: {"src_mask": torch.zeros(N, 2, L, L, dtype=torch.bool)},
    "src_mask int64": lambda bf: {"src_mask": torch.zeros(L, L, dtype=torch.int64)},
    "src_key_padding_mask shape": lambda bf: {
        "src_key_padding_mask": torch.zeros(N, L + 1, dtype=torch.bool)
    },
    "src_key_padding_mask 1-D": lambda bf: {"src_key_padding_mask": torch.zeros(L, dtype=torch.bool)},
    "src float64": lambda bf: {"src": _seq(bf, dtype=torch.float64)},
    "src int64": lambda bf: {"src": _seq(bf).long()},
    "src features": lambda bf: {"src": _seq(bf, e=E + 1)},
    "src list": lambda bf: {"src": _seq(bf).tolist()},
}
DECODER = {
    "memory batch": lambda bf: {"memory": _seq(bf, n=N + 1, length=S)},
    "memory features": lambda bf: {"memory": _seq(bf, length=S, e=E + 1)},
    "memory float64": lambda bf: {"memory": _seq(bf, length=S, dtype=torch.float64)},
    "memory list": lambda bf: {"memory": _seq(bf, length=S).tolist()},
    "memory_mask 2-D shape": lambda bf: {"memory_mask": torch.zeros(L, S + 1, dtype=torch.bool)},
    "memory_mask 3-D shape": lambda bf: {"memory_mask": torch.zeros(N, L, S, dtype=torch.bool)},
    "memory_key_padding_mask shape": lambda bf: {
        "memory_key_padding_mask": torch.zeros(N, S + 1, dtype=torch.bool)
    },
    "tgt_mask 2-D shape": lambda bf: {"tgt_mask": torch.zeros(L, L + 1, dtype=torch.bool)},
    "tgt float64": lambda bf: {"tgt": _seq(bf, dtype=torch.float64)},
}


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("mistake", [("encoder", m) for m in ENCODER] + [("decoder", m) for m in DECODER])
def test_inside_torchs_layers_after_convert(mistake, batch_first, mode):
    kind, name = mistake
    torch.manual_seed(0)
    if kind == "encoder":
        ref = nn.TransformerEncoderLayer(E, 2, dim_feedforward=16, dropout=0.0, batch_first=batch_first)
        call = {"src": _seq(batch_first), **ENCODER[name](batch_first)}
    else:
        ref = nn.TransformerDecoderLayer(E, 2, dim_feedforward=16, dropout=0.0, batch_first=batch_first)
        call = {"tgt": _seq(batch_first), "memory": _seq(batch_first, length=S), **DECODER[name](batch_first)}
    ref.train(mode == "train")
    ours = convert(ref)
    assert isinstance(ours.self_attn, MultiheadAttention)
    outcomes = []
    for module in (ref, ours):
        with torch.set_grad_enabled(mode == "train"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(Exception) as caught:  # noqa: PT011 -- the class is what is compared
                module(**call)
        outcomes.append(caught.value)
    theirs, mine = outcomes
    assert isinstance(mine, type(theirs)), f"torch {theirs!r}, the drop-in {mine!r}"


# ---- fuzzed: any module flags, any mistake -----------------------------------------------------------------


@st.composite
def configs(draw) -> Config:
    fused = draw(st.booleans())
    kdim = draw(st.sampled_from([None, None, 6, 10]))
    return Config(
        batch_first=draw(st.booleans()),
        heads=draw(st.sampled_from([1, 2, 4])),
        kdim=kdim,
        add_bias_kv=draw(st.booleans()),
        add_zero_attn=draw(st.booleans()),
        batched=draw(st.integers(0, 3)) > 0,
        fused=fused,
        need_weights=draw(st.booleans()),
        n=draw(st.integers(1, 3)),
        lq=draw(st.integers(1, 5)),
        ls=draw(st.integers(1, 5)),
    )


@fuzz(80)
@given(configs(), st.sampled_from(sorted(MISTAKES)))
def test_fuzzed_mistakes_raise_torchs_class(cfg, mistake):
    if mistake in FUSED_ANSWERS and cfg.fused:
        cfg = replace(cfg, fused=False)  # torch's fused path may answer it (test_fused_path_lenience)
    assume(MISTAKES[mistake][1](cfg) is not None)
    _check(cfg, mistake)
