"""A planner for machines you do not have: memory, traffic and time of each strategy, per rank and layer.

Dimensions: B batch, L total sequence length, P ranks, N = L / P tokens per rank, H query heads, Hkv
key/value heads, D head dim, b bytes per element, U Ulysses size and R = P / U ring length (hybrid).

:func:`plan` counts what :mod:`multihead.distributed` does (the same head split, the same messages),
so the bytes are exact for these implementations (the benchmark checks them against the collectives'
own byte counts); time comes from rates you give -- a compute rate for attention (FLOP/s) and a link
rate per rank (bytes/s) with a per-message latency -- or from a preset (:data:`PRESETS`). The model:

* compute: attention is 4 B H L^2 D FLOPs forward (half with ``causal``, balanced by zigzag), backward
  2.5x that; each rank does 1/P of it (Ulysses: its heads of everything; ring: its queries x all keys);
* ring: P steps; a step computes its block while the next K/V shard is in flight, so each step costs
  the longer of the two (forward: P - 1 K/V transfers; backward: P - 1 K/V and P dK/dV transfers);
* Ulysses: all-to-all of q, k, v to head shards, attention, all-to-all of the output back (backward
  the reverse): transfers are not overlapped with compute;
* hybrid: Ulysses inside groups of U ranks, then a ring of R over the groups' token sets.

Memory is the forward peak per rank in elements of the working dtype: this rank's q, k, v and
output plus the strategy's buffers (ring: K/V messages in flight; Ulysses: the K/V head of the whole
sequence a chunk reads and one window's queries, output and messages -- or, where a causal chunk is
attended whole, its queries and output of the whole sequence: half precision, as on GPUs, where
``dtype_bytes`` < 4; float32/float64 windows run one at a time on the CPU's fused kernel). With
``training=False`` (inference) Ulysses' windows run in K/V phases (:mod:`.phased`): part of the K/V head
held, the queries and outputs that see several phases sent again, and nothing goes backward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from .exchange import Chunk, HeadShare, auto_head_chunks, auto_windows, head_split, rank_chunks, window_edges
from .hybrid import choose_ulysses_size, hybrid_head_chunks
from .phased import phase_keys, phases_for, sends
from .ring import PIECE_KEYS
from .sharding import layout_positions

__all__ = ["PRESETS", "Estimate", "Machine", "plan"]


class Machine(NamedTuple):
    """Rates of one rank: ``compute`` attention FLOP/s, ``link`` bytes/s each rank sends, ``latency`` s
    per message."""

    compute: float
    link: float
    latency: float


PRESETS: dict[str, Machine] = {
    # bf16 attention at flash-attention 2's measured pace on H100/H800 (~300 TFLOP/s forward+backward,
    # ring-flash-attention's 8xH800 flash_attn baseline), per-direction link bandwidth as achieved
    "h100-nvlink": Machine(compute=300e12, link=300e9, latency=10e-6),  # NVLink 4 (450 GB/s peak)
    "h800-nvlink": Machine(compute=300e12, link=150e9, latency=10e-6),  # NVLink at 400 GB/s both ways
    "h100-ib": Machine(compute=300e12, link=45e9, latency=20e-6),  # InfiniBand NDR 400 Gb/s per GPU
    # A100: the H800 rate times the A100/H800 ratio of the same table's flash_attn baselines (94.7 / 154.7
    # iter/s fwd+bwd), NVLink 3 at 2/3 of its 300 GB/s per direction (as h100-nvlink takes of NVLink 4)
    "a100-nvlink": Machine(compute=185e12, link=200e9, latency=10e-6),
}
"""Named :class:`Machine` presets (pass ``machine=`` for your own, e.g. the rates the benchmark
measures with gloo on your CPU)."""


@dataclass(frozen=True)
class Estimate:
    """One strategy's cost per rank and layer."""

    strategy: str
    ulysses_size: int  # U (ring: 1, Ulysses: P)
    memory_bytes: int  # forward peak: this rank's q, k, v, output and the strategy's buffers
    sent_forward: int  # bytes this rank sends in the forward pass
    sent_backward: int  # bytes this rank sends in the backward pass
    seconds_forward: float
    seconds_backward: float

    @property
    def seconds(self) -> float:
        return self.seconds_forward + self.seconds_backward


def _ring(
    *, batch: int, tokens: int, heads: int, kv_heads: int, dim: int, ranks: int, b: int, pieces: int
) -> tuple[int, int, int]:
    """Ring over ``ranks`` of ``tokens`` each: (peak elements beyond q/k/v/out, sent fwd, sent bwd) in bytes."""
    kv = 2 * batch * kv_heads * tokens * dim * b  # one K/V shard
    in_flight = 0 if ranks == 1 else 2 * kv // pieces  # two alternating receive buffers
    lse = batch * heads * tokens * 4
    return in_flight + lse, (ranks - 1) * kv, (ranks - 1) * kv + (ranks if ranks > 1 else 0) * kv


def _ulysses(
    *,
    batch: int,
    tokens: int,
    heads: int,
    kv_heads: int,
    dim: int,
    ranks: int,
    b: int,
    counts: list[int],
    split: bool = True,
    phased: bool = False,
    causal: bool = True,
) -> tuple[int, int, int, float, list[Chunk], int]:
    """Ulysses over ``ranks`` of ``tokens`` each, each rank's heads in ``counts[s]`` chunks: (extra peak
    bytes, sent fwd, sent bwd, largest share of the heads, that rank's chunks, all-to-alls forward),
    rank 0's (the largest share: tensor_split gives the first ranks the extra heads). ``split``: the
    windows are attended one at a time (else a chunk's queries are held whole). ``phased``: a forward
    without autograd, in K/V phases where it runs (:mod:`.phased`; zigzag positions, ``causal``)."""
    shares = head_split(heads, kv_heads, ranks)
    unit = batch * tokens * dim * b  # one head of one rank's tokens
    mine = shares[0]
    # q/k/v to the other ranks' heads, and the output of my heads for the other ranks' tokens (chunks
    # and windows change when things move, not how much: each K/V slot is sent once)
    qkv_out = sum((s.heads + 2 * len(s.kv)) * unit for s in shares[1:])
    out_back = mine.heads * (ranks - 1) * unit
    fwd = qkv_out + out_back
    # backward: the output's gradient to the head owners, then dq, dk, dv back to the token owners
    bwd = sum(s.heads * unit for s in shares[1:]) + (mine.heads + 2 * len(mine.kv)) * (ranks - 1) * unit
    per_rank = rank_chunks(shares, counts)
    chunks = [cs[0] for cs in per_rank if cs[0].q]
    w_most = max(len(c.q) for cs in per_rank for c in cs)
    w = auto_windows(batch, tokens * ranks, w_most, dim, ranks)
    # all-to-alls: per exchange of chunks, K and V (when a slot travels) and q and the output, per window
    calls = sum((2 if any(c.new_kv for c in cs) else 0) + 2 for cs in per_rank) * w
    whole = ranks * unit  # one head of every token
    phases = phases_for(per_rank) if phased and split and w > 1 and ranks > 1 else 1
    if phases > 1:
        return _phased(
            shares, per_rank, batch=batch, tokens=tokens, dim=dim, b=b, w=w, causal=causal, phases=phases
        )
    # the most alive at once, beyond this rank's q, k, v and output, per chunk of w heads reading s slots.
    # One window: K, then V arriving (K whole, V's message and its receive buffer); the slot and q
    # arriving; the slot, q and the output; the slot, the output's message and what comes back. W
    # windows: the slot (K and V whole) and one window's messages (the rank whose tokens a window holds
    # sends them to all P ranks): K/V (P + 1) s / W, q and output (P + 3) w / W.
    if w == 1 or not split:
        most = max((max(3 * len(c.kv), 2 * len(c.kv) + 2 * len(c.q)) for c in chunks), default=0)
        extra = most * whole
    else:
        extra = max(
            (2 * len(c.kv) * whole + max(len(c.kv), len(c.q)) * (ranks + 3) * whole // w for c in chunks),
            default=0,
        )
    if ranks == 1:  # one rank: plain attention, no exchange
        extra, calls = 0, 0
    return extra, fwd, bwd, mine.heads / heads, chunks, calls


def _phased(
    shares: list[HeadShare],
    per_rank: list[list[Chunk]],
    *,
    batch: int,
    tokens: int,
    dim: int,
    b: int,
    w: int,
    causal: bool,
    phases: int,
) -> tuple[int, int, int, float, list[Chunk], int]:
    """:func:`_ulysses` for the phased forward (:mod:`.phased`), rank 0's, zigzag: each K/V slot travels
    once; a query window once per phase it sees, and its output (with its log-sum-exp: one element more
    per row) home as often; no backward. Memory: the largest phase's part of the slot, one window's
    messages, and the home log-sum-exp of every head of this rank's tokens."""
    ranks = len(shares)
    length = ranks * tokens
    edges = window_edges(length, min(w, length))
    goes = [len(g) for g in sends(edges, edges, phases, 0 if causal else None)]
    held = [  # [s][i]: rank s's tokens in window i
        [int(((p >= lo) & (p < hi)).sum()) for lo, hi in zip(edges, edges[1:])]
        for p in layout_positions(length, ranks, "zigzag")
    ]
    token = batch * dim * b  # one head of one token
    unit = token * tokens  # one head of one rank's tokens
    mine = shares[0]
    kv = sum(2 * len(s.kv) for s in shares[1:]) * unit
    q = sum(s.heads for s in shares[1:]) * token * sum(n * g for n, g in zip(held[0], goes))
    back = sum(n * g for s in range(1, ranks) for n, g in zip(held[s], goes))
    out = mine.heads * batch * (dim + 1) * b * back
    slots = sum(1 for cs in per_rank if any(c.new_kv for c in cs))
    calls = slots * 2 * w + len(per_rank) * 2 * sum(goes)
    whole = ranks * unit  # one head of every token
    part = max(len(p) for p in phase_keys(edges, phases))  # key windows of the largest phase
    chunks = [cs[0] for cs in per_rank if cs[0].q]
    extra = max(
        (
            2 * len(c.kv) * whole * part // w + max(len(c.kv), len(c.q)) * (ranks + 3) * whole // w
            for c in chunks
        ),
        default=0,
    )
    heads = sum(s.heads for s in shares)
    return extra + heads * batch * tokens * b, kv + q + out, 0, mine.heads / heads, chunks, calls


def plan(
    seq_len: int,
    *,
    heads: int,
    kv_heads: int | None = None,
    head_dim: int,
    world: int,
    batch: int = 1,
    dtype_bytes: int = 2,
    causal: bool = True,
    machine: str | Machine = "h100-nvlink",
    ulysses_size: int | None = None,
    pieces: int | None = None,
    head_chunks: int | None = None,
    training: bool = True,
) -> dict[str, Estimate]:
    """Predict, for ring, Ulysses and hybrid, memory per rank, bytes sent per rank and time, per layer.

    Args:
        seq_len: L, the total tokens of a sequence (split over ``world`` ranks).
        heads, kv_heads, head_dim: H, Hkv (default H), D.
        world: P ranks. batch: B sequences. dtype_bytes: b (2 for bf16/fp16, 4 for fp32).
        causal: halves the attention FLOPs (zigzag keeps the ranks balanced).
        machine: a :data:`PRESETS` name or a :class:`Machine` with your own rates.
        ulysses_size: U for hybrid (None: the largest size dividing P, H and Hkv).
        pieces: how many pieces a remote K/V shard is streamed in (the ring's in-flight memory / pieces);
            None: as :func:`~multihead.distributed.ring_attention` chooses (pieces of >= 1024 keys, <= 4).
        head_chunks: the chunks Ulysses and hybrid exchange each rank's heads in (None: as they choose;
            see :func:`~multihead.distributed.ulysses_attention`).
        training: a forward that autograd records, and its backward. False: inference (no backward:
            its bytes and time are 0), where Ulysses streams a chunk's K/V in phases when it attends in
            windows (:mod:`multihead.distributed.phased`): half the K/V head held, queries and outputs
            that see both halves sent twice.

    Returns ``{"ring": Estimate, "ulysses": Estimate, "hybrid": Estimate}``. For ``world=4``, L = 16k,
    H = Hkv = 8, D = 64 in float32, the ring sends 3 K/V shards forward: 3 * 2 * 4096 * 8 * 64 * 4 bytes.
    """
    for name, flag in (("causal", causal), ("training", training)):
        if not isinstance(flag, bool):
            raise TypeError(f"plan: {name} must be True or False, got {flag!r}")
    if isinstance(machine, str) and machine not in PRESETS:
        raise ValueError(
            f"machine must be one of {sorted(PRESETS)} or a multihead.distributed.Machine, got {machine!r}"
        )
    hkv = heads if kv_heads is None else kv_heads
    n = seq_len // world
    job = _Job(
        batch=batch,
        seq_len=seq_len,
        tokens=n,
        heads=heads,
        kv_heads=hkv,
        dim=head_dim,
        world=world,
        b=dtype_bytes,
        causal=causal,
        rates=PRESETS[machine] if isinstance(machine, str) else machine,
        pieces=max(1, min(4, n // PIECE_KEYS)) if pieces is None else pieces,
        head_chunks=head_chunks,
    )
    out = {
        "ring": _ring_estimate(job),
        "ulysses": _ulysses_estimate(job, phased=not training),
        "hybrid": _hybrid_estimate(job, ulysses_size),
    }
    if not training:  # a forward only: nothing goes backward
        out = {k: replace(e, sent_backward=0, seconds_backward=0.0) for k, e in out.items()}
    return out


@dataclass(frozen=True)
class _Job:
    """What :func:`plan` was asked, resolved: the shapes (N = ``tokens`` per rank), the rates, the pieces."""

    batch: int
    seq_len: int
    tokens: int
    heads: int
    kv_heads: int
    dim: int
    world: int
    b: int
    causal: bool
    rates: Machine
    pieces: int
    head_chunks: int | None

    @property
    def own(self) -> int:
        """Bytes of this rank's q, out (H heads) and k, v (Hkv heads)."""
        return (2 * self.heads + 2 * self.kv_heads) * self.batch * self.tokens * self.dim * self.b

    @property
    def compute(self) -> tuple[float, float]:
        """Seconds of one rank's 1/P of the attention: (forward, backward = 2.5x forward)."""
        flops = 4 * self.batch * self.heads * self.seq_len**2 * self.dim * (0.5 if self.causal else 1.0)
        fwd = flops / self.world / self.rates.compute
        return fwd, 2.5 * fwd

    def ring_time(self, kv_bytes: int, ranks: int, fwd: float, bwd: float) -> tuple[float, float]:
        """(forward, backward) seconds of a ring of ``ranks`` steps, each step's compute overlapping the
        next K/V shard's transfer (``kv_bytes``; backward: K/V and dK/dV)."""
        if ranks == 1:
            return fwd, bwd
        step = kv_bytes / self.rates.link + self.rates.latency
        return (
            fwd / ranks + (ranks - 1) * max(fwd / ranks, step),
            bwd / ranks + (ranks - 1) * max(bwd / ranks, 2 * step),
        )


def _ring_estimate(job: _Job) -> Estimate:
    """The ring over all P ranks."""
    extra, sf, sb = _ring(
        batch=job.batch,
        tokens=job.tokens,
        heads=job.heads,
        kv_heads=job.kv_heads,
        dim=job.dim,
        ranks=job.world,
        b=job.b,
        pieces=job.pieces,
    )
    kv_shard = 2 * job.batch * job.kv_heads * job.tokens * job.dim * job.b
    tf, tb = job.ring_time(kv_shard, job.world, *job.compute)
    return Estimate("ring", 1, job.own + extra, sf, sb, tf, tb)


def _ulysses_estimate(job: _Job, *, phased: bool) -> Estimate:
    """Ulysses over all P ranks (``phased``: an inference forward, in K/V phases where it runs)."""
    shares = head_split(job.heads, job.kv_heads, job.world)
    most = max(x.heads for x in shares)
    count = job.head_chunks or auto_head_chunks(job.batch, job.seq_len, most, job.dim)
    extra, sf, sb, share, _, calls = _ulysses(
        batch=job.batch,
        tokens=job.tokens,
        heads=job.heads,
        kv_heads=job.kv_heads,
        dim=job.dim,
        ranks=job.world,
        b=job.b,
        counts=[count] * job.world,
        split=not job.causal or job.b >= 4,  # causal windows one at a time: the CPU's fused kernel
        phased=phased,
        causal=job.causal,
    )
    compute_fwd, compute_bwd = job.compute
    heavy = share * job.world  # the rank with the most heads sets the pace
    msgs = calls * (job.world - 1) * job.rates.latency  # every all-to-all: a message to each other rank
    tf = compute_fwd * heavy + sf / job.rates.link + msgs
    tb = compute_bwd * heavy + sb / job.rates.link + msgs
    return Estimate("ulysses", job.world, job.own + extra, sf, sb, tf, tb)


def _hybrid_estimate(job: _Job, ulysses_size: int | None) -> Estimate:
    """Ulysses inside groups of U ranks, a ring of R = P / U over the groups."""
    hkv, n, b = job.kv_heads, job.tokens, job.b
    u = choose_ulysses_size(job.heads, hkv, job.world) if ulysses_size is None else ulysses_size
    r = job.world // u
    shares = head_split(job.heads, hkv, u)
    counts = (
        [job.head_chunks] * u if job.head_chunks else hybrid_head_chunks(shares, job.batch, n * u, job.dim)
    )
    extra_u, uf, ub, share, chunks, calls = _ulysses(
        batch=job.batch, tokens=n, heads=job.heads, kv_heads=hkv, dim=job.dim, ranks=u, b=b, counts=counts
    )
    # the ring of each chunk over the R groups' N_g = n * u tokens: its slots go around once per chunk
    whole_g = job.batch * n * u * job.dim * b  # one head of a group's tokens
    rf = rb = 0
    during = []  # per chunk: its slot, q and the ring's running output, the ring's buffers
    for c in chunks:
        e, f, bw = _ring(
            batch=job.batch,
            tokens=n * u,
            heads=len(c.q),
            kv_heads=len(c.kv),
            dim=job.dim,
            ranks=r,
            b=b,
            pieces=job.pieces,
        )
        rf, rb = rf + f, rb + bw
        during.append((2 * len(c.kv) + 2 * len(c.q)) * whole_g + e)
    kv_group = 2 * job.batch * len(shares[0].kv) * n * u * job.dim * b
    compute_fwd, compute_bwd = job.compute
    heavy = share * u
    rtf, rtb = job.ring_time(kv_group, r, compute_fwd * heavy, compute_bwd * heavy)
    msgs = calls * (u - 1) * job.rates.latency
    if u == 1:  # groups of one: the plain ring (no exchange, no chunks)
        extra_h, rf, rb = _ring(
            batch=job.batch,
            tokens=n,
            heads=job.heads,
            kv_heads=hkv,
            dim=job.dim,
            ranks=r,
            b=b,
            pieces=job.pieces,
        )
    elif r == 1:  # one group: plain Ulysses, no ring
        extra_h = extra_u
    else:
        extra_h = max([extra_u, *during])
    link = job.rates.link
    return Estimate(
        "hybrid", u, job.own + extra_h, uf + rf, ub + rb, rtf + uf / link + msgs, rtb + ub / link + msgs
    )
