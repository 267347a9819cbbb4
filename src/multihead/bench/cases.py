"""The benchmark cases: shapes, modes, contenders and targets, as plain records.

Dimensions: B batch, Lq/Lk query/key lengths (self-attention: both L), E embed_dim, H query heads,
Hkv key/value heads, D = E // H head dim.

FLOPs of one call (:func:`flops`), counting a multiply-add as 2:

* projections (module and decode levels): ``2*B*Lq*E*(H*D + 2*Hkv*D)`` for Q, K and V of the Lq new
  tokens (``2*B*L*E*3E`` for plain multi-head self-attention) plus ``2*B*Lq*E*E`` for the output;
* attention: ``4*B*H*D`` per visible (query, key) pair: ``Lq*Lk`` pairs, or with ``causal`` (bottom-right
  aligned) ``Lq*Lk - Lq*(Lq-1)/2``; a ragged batch counts each sequence's pairs (what is useful: the
  padded contender does more), a causal sliding window of W keys ``sum_i min(i + 1, W)``, a mask case
  the pairs its mask allows (:func:`multihead.bench.masks.visible_pairs`);
* forward + backward: 3x the projections (two matmuls per matmul in backward) and 3.5x the attention
  (flash-attention's convention: the backward recomputes the scores, 2.5x the forward).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

from .targets import Target

__all__ = [
    "OURS",
    "Case",
    "Run",
    "Suite",
    "Sweep",
    "cpu_suite",
    "cuda_suite",
    "flops",
    "ragged_lengths",
    "row",
]

OURS = "multihead"

Mode = Literal["forward", "train", "weights", "forward-train-module"]
Level = Literal["module", "attention", "decode"]


class Run(NamedTuple):
    """One row of a case: ``contender`` (a key of :data:`multihead.bench.contenders.CONTENDERS`) run on
    the case with the fields in ``changes`` replaced. ``label`` names the row (and targets' peers)."""

    label: str
    contender: str
    changes: tuple[tuple[str, object], ...] = ()


def row(contender: str, **changes: object) -> Run:
    """``row("multihead", causal=False)`` -> the row ``multihead@causal=False``."""
    label = contender + "".join(f"@{k}={v}" for k, v in changes.items())
    return Run(label, contender, tuple(changes.items()))


@dataclass(frozen=True)
class Case:
    """One benchmark case: a shape, a mode and the contenders that run it.

    ``length``: Lk (and Lq unless ``query_length``). ``level``: ``"module"`` (projections + attention,
    input (B, L, E)), ``"attention"`` (attention alone, q/k/v (B, H, L, D)) or ``"decode"`` (one
    decoding step of ``query_length`` new tokens with ``length`` keys/values already cached).
    ``mode``: ``"forward"`` (eval, no grad), ``"train"`` (forward + backward), ``"weights"`` (eval
    forward that also returns the per-head weights) or ``"forward-train-module"`` (a module in train
    mode, forward under no grad: torch's slow path). ``memory_only``: one call per contender (long
    sequences), for its peak memory. ``own_process``: measured in a fresh process of its own (a clean
    heap; a one-rank process group for ring attention). ``steps``: decoding steps per timed sample
    (cached length L, L+1, ..., L+steps-1; times are per step), so that a sample outlasts the timer's
    and the scheduler's granularity. ``yardstick``: time the matmul yardstick in the same rounds (off
    where the case's rate means nothing, e.g. one decoding step). ``subject``: the run every ratio and
    target refers to.
    """

    name: str
    batch: int
    length: int
    embed_dim: int
    heads: int
    kv_heads: int | None = None
    query_length: int | None = None
    causal: bool = False
    mode: Mode = "forward"
    level: Level = "module"
    dtype: str = "float32"
    memory_only: bool = False
    measure_memory: bool = True
    own_process: bool = False
    steps: int = 1
    yardstick: bool = True
    subject: str = OURS
    lengths: tuple[int, ...] = ()
    window: int | None = None
    window_form: str = "library"  # the window's mask function: "library" (sliding_window_fn) or "lambda"
    mask: str | None = None  # a mask case: a kind of multihead.bench.masks.KINDS
    # how the mask is given: "lambda", "library", "segments", "blockmask" ("rebuilt": flex; "new ids": ours)
    mask_form: str = "lambda"
    rounds: int | None = None
    sdpa_backend: str | None = None  # the sdpa contender in one SDPA backend ("flash", "efficient", "cudnn")
    runs: tuple[Run, ...] = ()
    targets: tuple[Target, ...] = ()

    @property
    def lq(self) -> int:
        """Query length Lq."""
        return self.length if self.query_length is None else self.query_length

    @property
    def lk(self) -> int:
        """Key length Lk the attention spans (a decoding step: the cached keys and the new ones)."""
        return self.length + self.lq if self.level == "decode" else self.length

    def variant(self, r: Run) -> Case:
        """This case as run ``r`` runs it."""
        return replace(self, **dict(r.changes)) if r.changes else self

    def shape(self) -> str:
        """``"B=8 L=512 E=512 H=8"`` (and Hkv, Lq where they differ)."""
        if self.lengths:
            n = self.lengths
            words = f"{len(n)} sequences of {min(n)}-{max(n)} tokens (sum {sum(n)}) E={self.embed_dim} H={self.heads}"
            return words + (f" Hkv={self.kv_heads}" if self.kv_heads else "")
        words = f"B={self.batch} L={self.length} E={self.embed_dim} H={self.heads}"
        words += f" window={self.window}" if self.window else ""
        words += f" Hkv={self.kv_heads}" if self.kv_heads else ""
        return words + (f" Lq={self.lq}" if self.lq != self.length else "")


class Sweep(NamedTuple):
    """A target over several cases (shortest first), e.g. decode step time flat in the cached length."""

    name: str
    cases: tuple[str, ...]
    subject: str
    target: Target


class Suite(NamedTuple):
    cases: list[Case]
    sweeps: list[Sweep]

    def only(self, text: str | None) -> Suite:
        """The cases whose name contains ``text``, or one of its comma-separated parts (and the sweeps
        all of whose cases remain)."""
        if not text:
            return self
        parts = [p for p in text.split(",") if p]
        cases = [c for c in self.cases if any(p in c.name for p in parts)]
        names = {c.name for c in cases}
        return Suite(cases, [s for s in self.sweeps if set(s.cases) <= names])


def flops(case: Case) -> float:
    """FLOPs of one call of ``case`` (see the module docstring)."""
    b, lq, lk, e, h = case.batch, case.lq, case.lk, case.embed_dim, case.heads
    hkv, d = case.kv_heads or h, e // h
    pairs = lq * lk - (lq * (lq - 1) // 2 if case.causal else 0)
    if case.mask:  # a mask case: the pairs its mask allows
        from .masks import visible_pairs

        pairs = visible_pairs(case.mask, lk)
    elif case.lengths:
        b, pairs = 1, sum(n * n - (n * (n - 1) // 2 if case.causal else 0) for n in case.lengths)
    elif case.window:  # causal window of W keys: query i sees min(i + 1, W) of them (Lq = Lk)
        w = min(case.window, lq)
        pairs = w * (w + 1) // 2 + (lq - w) * w
    attn = 4 * b * h * d * pairs
    proj = 0 if case.level == "attention" else 2 * b * lq * e * (h * d + 2 * hkv * d) + 2 * b * lq * e * e
    if case.mode == "train":
        return 3 * proj + 3.5 * attn
    return float(proj + attn)


# ----------------------------------------------------------------------------------------------
# Suites
# ----------------------------------------------------------------------------------------------

_PEERS = (row("torch"), row("naive"), row("keras"))
DECODE_LENGTHS = (256, 512, 1024, 2048, 4096, 8192)


def _decode_cases(quick: bool) -> tuple[list[Case], Sweep]:
    """One MultiHeadAttention decoding step (KV cache, causal) vs its bare work, over cached lengths."""
    lengths, e = ((16, 64), 32) if quick else (DECODE_LENGTHS, 512)
    cases = [
        Case(f"decode step, cached {n}", 1, n, e, 8, query_length=1, causal=True, level="decode",
             measure_memory=False, steps=2 if quick else 16, yardstick=False, runs=(row(OURS), row("bare")),
             targets=(Target("time", "bare", "<=", 1.3),) if n == 4096 else ())
        for n in lengths
    ]  # fmt: skip
    sweep = Sweep("decode step / bare work, flat in length", tuple(c.name for c in cases), OURS,
                  Target("growth", "bare", "<=", 1.25))  # fmt: skip
    return cases, sweep


def ragged_lengths(
    count: int = 32, shortest: int = 32, longest: int = 1024, seed: int = 0
) -> tuple[int, ...]:
    """``count`` long-tailed sequence lengths in [shortest, longest] (fixed ``seed``): most are short, a
    few long, the longest is ``longest`` (log-uniform raised to a power, as real corpora look)."""
    gen = random.Random(seed)
    span = math.log(longest / shortest)
    lengths = [round(shortest * math.exp(span * gen.random() ** 2)) for _ in range(count - 1)]
    return (*lengths, longest)


def _modern_cases(quick: bool) -> list[Case]:
    """Attention whose cost follows the real tokens: a ragged batch packed with segment ids (against its
    sequences one by one and the padded batch), and a sliding window given as a mask function: the
    library's ``sliding_window_fn`` (whose key range lets tiles be skipped unevaluated) and the same rule
    as a plain lambda (evaluated up to the causal diagonal), against the unmasked call."""
    lengths = (3, 7, 2, 5) if quick else ragged_lengths()
    e = 32 if quick else 512
    runs = (row("packed"), row("sequences"), row("padded"))
    ragged = [
        Case(f"ragged batch {mode}", 1, sum(lengths), e, 8, causal=True, mode=mode, level="attention",
             lengths=lengths, subject="packed", runs=runs,
             targets=(Target("time", "sequences", "<=", bound), Target("speedup", "padded", ">=", 2.0)))
        for mode, bound in (("forward", 1.15), ("train", 1.25))
    ]  # fmt: skip
    n, w = (64, 8) if quick else (16384, 512)
    window = Case(f"sliding window {w} as a mask function", 1, n, e, 8, causal=True, level="attention",
                  window=w, rounds=None if quick else 7,
                  runs=(row(OURS), row(OURS, window_form="lambda"), row(OURS, window=None, causal=False)),
                  targets=(Target("time", f"{OURS}@window=None@causal=False", "<=", 0.2),
                           Target("memory", f"{OURS}@window=None@causal=False", "<=", 1.2)))  # fmt: skip
    two_sided = Case(f"two-sided window {w} as a lambda", 1, n, e, 8, level="attention", mask="two-sided window",
                     rounds=None if quick else 7, yardstick=False,
                     runs=(row(OURS), row(OURS, mask=None)),
                     targets=(Target("time", f"{OURS}@mask=None", "<=", 0.2),
                              Target("memory", f"{OURS}@mask=None", "<=", 1.2)))  # fmt: skip
    return [*ragged, window, two_sided]


def _flex_cases(quick: bool) -> list[Case]:
    """Masks as FlexAttention users hold them, against ``torch.compile(flex_attention)`` with the BlockMask
    built once (and rebuilt on every call): plain lambdas, documents as segment ids and as a mask_mod, a
    BlockMask passed straight in; and a plain lambda's forward+backward against SDPA's dense bool mask."""
    e = 32 if quick else 512
    forms = {
        "two-sided window": ("lambda", "library"),
        "causal window": ("lambda", "library"),
        "prefix-LM": ("lambda", "library"),
        "chunked": ("lambda", "library"),
        "documents": ("segments", "lambda"),
    }
    if quick:  # each lambda is a compile of its own (about 5 s of CPU): one of each form checks the machinery
        forms = {k: forms[k] for k in ("causal window", "documents")}
    cases = []
    for n in (64,) if quick else (4096, 16384):
        for kind, (form, other) in forms.items():
            runs = (row(OURS), row(OURS, mask_form=other), row("flex"), row("flex", mask_form="rebuilt"))
            targets = [Target("time", "flex", "<=", 1.0), Target("time", "flex@mask_form=rebuilt", "<=", 0.8)]
            if other == "library":
                targets.append(Target("time", f"{OURS}@mask_form=library", "<=", 1.2))
            cases.append(Case(f"flex: {kind} ({form}) L={n}", 1, n, e, 8, level="attention", mask=kind,
                              mask_form=form, yardstick=False, rounds=None if quick else 5,
                              runs=runs, targets=tuple(targets)))  # fmt: skip
        cases.append(Case(f"flex: causal window (BlockMask) L={n}", 1, n, e, 8, level="attention",
                          mask="causal window", mask_form="blockmask", yardstick=False,
                          rounds=None if quick else 5, runs=(row(OURS), row("flex")),
                          targets=(Target("time", "flex", "<=", 1.0),)))  # fmt: skip
    n = 64 if quick else 4096
    cases.append(Case(f"flex: causal window (lambda) forward+backward L={n}", 1, n, e, 8, level="attention",
                      mode="train", mask="causal window", yardstick=False, rounds=None if quick else 5,
                      runs=(row(OURS), row("sdpa")), targets=(Target("time", "sdpa", "<=", 0.35),)))  # fmt: skip
    return cases


def cpu_suite(quick: bool = False) -> Suite:
    """The CPU cases (tiny shapes with ``quick``: the smoke test runs them in a few seconds)."""

    def s(b: int, n: int) -> tuple[int, int]:
        return (2, 8) if quick else (b, n)

    e = 32 if quick else 512
    cases = [
        Case("self-attention forward", *s(8, 512), e, 8, runs=(row(OURS), *_PEERS),
             targets=(Target("speedup", "torch", ">=", 1.5), Target("matmul", None, ">=", 0.85))),
        Case("self-attention forward+backward", *s(8, 512), e, 8, mode="train", runs=(row(OURS), *_PEERS),
             targets=(Target("speedup", "torch", ">=", 1.15), Target("matmul", None, ">=", 0.70))),
        Case("forward returning weights", *s(8, 512), e, 8, mode="weights",
             runs=(row(OURS), row(OURS, mode="forward"), *_PEERS),
             targets=(Target("time", f"{OURS}@mode=forward", "<=", 1.5), Target("speedup", "torch", ">=", 1.3))),
        Case("self-attention forward, bfloat16", *s(8, 512), e, 8, dtype="bfloat16", yardstick=False,
             runs=(row(OURS), row("torch")), targets=(Target("speedup", "torch", ">=", 1.0),)),
        Case("causal forward", *s(2, 2048), e, 8, causal=True,
             runs=(row(OURS), row(OURS, causal=False), row("torch"), row("naive")),
             targets=(Target("time", f"{OURS}@causal=False", "<=", 0.70),)),
        Case("causal attention", *s(2, 2048), e, 8, causal=True, level="attention", yardstick=False,
             runs=(row(OURS), row(OURS, causal=False), row("sdpa"), *(() if quick else (row("flex"),))),
             targets=(Target("time", f"{OURS}@causal=False", "<=", 0.55), Target("time", "sdpa", "<=", 1.0),
                      *(() if quick else (Target("time", "flex", "<=", 1.0),)))),
        Case("seed shape forward", *((4, 5) if quick else (64, 5)), e, 8, runs=(row(OURS), *_PEERS),
             targets=(Target("speedup", "torch", ">=", 1.0),)),
        Case("grouped-query forward (8 q / 2 kv heads)", *s(1, 2048), e, 8, kv_heads=2,
             runs=(row(OURS), row(OURS, kv_heads=8), row("torch")),
             targets=(Target("speedup", f"{OURS}@kv_heads=8", ">=", 1.0),)),
        Case("long forward, memory", *s(1, 64 if quick else 32768), e, 8, memory_only=True,
             runs=(row(OURS), row("torch"), row("torch", mode="forward-train-module")),
             targets=(Target("memory", "torch", "<=", 0.8),)),
        Case("long forward+backward, memory", *s(1, 64 if quick else 8192), e, 8, mode="train",
             memory_only=True, runs=(row(OURS), row("torch")), targets=(Target("memory", "torch", "<=", 1.0),)),
    ]  # fmt: skip
    decode, sweep = _decode_cases(quick)
    ring = Case("ring attention, one rank", 1, 64 if quick else 4096, 16 if quick else 512, 8, causal=True,
                mode="train", level="attention", own_process=True, subject="ring",
                runs=(row("ring"), row(OURS)),
                targets=(Target("time", OURS, "<=", 1.3), Target("memory", OURS, "<=", 1.5)))  # fmt: skip
    return Suite([*cases, *decode, ring, *_modern_cases(quick), *_flex_cases(quick)], [sweep])


SDPA_BACKENDS = ("flash", "efficient", "cudnn")
#: FlashAttention's benchmark shapes: B*L = 16k tokens, model width 2048 (32 heads of 64, 16 of 128)
CUDA_LENGTHS, CUDA_TOKENS, CUDA_WIDTH = (1024, 4096, 16384), 16384, 2048


def _sdpa_rows() -> tuple[Run, ...]:
    return tuple(row("sdpa", sdpa_backend=b) for b in SDPA_BACKENDS)


def _cuda_grid(quick: bool) -> list[Case]:
    """Attention alone and the whole module, bf16, at every (L, D, causal, mode) of the grid: against each
    SDPA backend (and, at the module level, the same projections around it, and torch's MHA); compiled
    flex_attention as a peer at one causal shape (each compile costs seconds of the run)."""
    lengths = (128, 256) if quick else CUDA_LENGTHS
    tokens, width = (512, 256) if quick else (CUDA_TOKENS, CUDA_WIDTH)
    cases = []
    for level in ("attention", "module"):
        for d in (64, 128):
            for causal in (False, True):
                for n in lengths:
                    for mode in ("forward", "train"):
                        peers = _sdpa_rows()
                        if level == "module":  # and the module held to cuDNN's kernel: its own overhead
                            peers += (row(OURS, sdpa_backend="cudnn"), row("torch"))
                        elif n == lengths[1] and d == 128 and causal:
                            peers += (row("flex"),)
                        what = f"{level} L={n} D={d}{' causal' if causal else ''} {mode}"
                        bound = 1 / 0.95 if level == "module" else 1.0
                        cases.append(Case(what, tokens // n, n, width, width // d, causal=causal, mode=mode,
                                          level=level, dtype="bfloat16", runs=(row(OURS), *peers),
                                          targets=(Target("time", "sdpa", "<=", bound),)))  # fmt: skip
    return cases


def _cuda_masks(quick: bool) -> list[Case]:
    """A causal sliding window of L/8 and packed documents at L = 16k, bf16: the library's mask function
    (or segment ids) and a FlexAttention BlockMask passed in, against the unmasked call, SDPA with the dense
    bool mask, and compiled flex_attention with the BlockMask built once; for documents also new segment
    ids on every call against flex building its BlockMask on every call."""
    n, width, heads = (256, 256, 2) if quick else (16384, 2048, 16)
    cases = []
    for kind, form, modes in (("causal window L/8", "library", ("forward", "train")),
                              ("documents", "segments", ("forward",))):  # fmt: skip
        for mode in modes:
            runs = (
                row(OURS),
                row(OURS, mask_form="blockmask"),
                row(OURS, mask=None),
                row("sdpa"),
                row("flex"),
            )
            if kind == "documents":
                # new ids every call (a training step's) against flex rebuilding its BlockMask
                runs += (row(OURS, mask_form="new ids"), row("flex", mask_form="rebuilt"))
            targets = [Target("time", "flex", "<=", 1.0), Target("time", "sdpa", "<=", 0.5)]
            if kind.startswith("causal window"):
                targets.append(Target("time", f"{OURS}@mask=None", "<=", 0.25))
            cases.append(Case(f"mask: {kind} ({form}) L={n} {mode}", 1, n, width, heads, mode=mode,
                              level="attention", dtype="bfloat16", mask=kind, mask_form=form,
                              runs=runs, targets=tuple(targets)))  # fmt: skip
    return cases


def cuda_suite(quick: bool = False) -> Suite:
    """The CUDA cases: the (L, D, causal, mode) grid of attention and of the module against SDPA's
    backends, masks through block skipping, and decoding steps, all in bf16."""
    decode, sweep = _decode_cases(quick)
    graphed = {DECODE_LENGTHS[2], DECODE_LENGTHS[-1]}  # a compile each: two lengths
    decode = [
        replace(
            c, dtype="bfloat16", runs=c.runs + ((row("graphed"),) if quick or c.length in graphed else ())
        )
        for c in decode
    ]
    return Suite([*_cuda_grid(quick), *_cuda_masks(quick), *decode], [sweep])
