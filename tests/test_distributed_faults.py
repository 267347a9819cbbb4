"""Faults in sequence-parallel calls: ranks that disagree all raise the same ValueError naming it; a rank
that dies makes the others fail within the group's timeout with a message that says so. Never a hang."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from rank_errors import Caught

import multihead as mh
from multihead import distributed as mhd


def _disagreements():
    rank = dist.get_rank()
    caught = Caught()
    attempt = caught.attempt

    x = torch.randn(1, 4, 8, 4)  # (B, H, L_r, D)
    attempt("layout", lambda: mhd.ring_attention(x, x, x, layout="zigzag" if rank == 0 else "contiguous"))
    attempt("strategy", lambda: (mhd.ring_attention if rank == 0 else mhd.ulysses_attention)(x, x, x))
    heads = torch.randn(1, 4 if rank == 0 else 2, 8, 4)
    attempt("heads", lambda: mhd.ulysses_attention(heads, heads, heads))
    odd = torch.randn(1, 4, 5 if rank == 0 else 3, 4)  # local lengths no zigzag cut produces
    attempt("lengths", lambda: mhd.ulysses_attention(odd, odd, odd, layout="zigzag"))
    attempt("chunks", lambda: mhd.ulysses_attention(x, x, x, head_chunks=2 if rank == 0 else None))
    attempt("softcap", lambda: mhd.ring_attention(x, x, x, softcap=5.0 if rank == 0 else None))
    attempt("bad-chunks", lambda: mhd.ulysses_attention(x, x, x, head_chunks=0 if rank == 0 else 1))
    sinks = torch.tensor([float("nan") if rank == 0 else 0.0, 0.0, 0.0, 0.0])  # (H,): one rank's is NaN
    attempt("nan-sink", lambda: mhd.ring_attention(x, x, x, sinks=sinks))
    model = mh.MultiHeadAttention(16, 4)

    def enter():
        with mhd.context_parallel(model, strategy="ring" if rank == 0 else "hybrid"):
            pass

    attempt("cp-strategy", enter)
    y = x.clone().requires_grad_()
    attempt("after", lambda: mhd.ulysses_attention(y, y, y, causal=True).sum().backward())  # still usable
    return caught


def test_ranks_that_disagree_all_raise_the_same_error():
    per_rank = mhd.launch(_disagreements, 2, timeout=60, start_method="fork")
    words = {
        "layout": "same layout; ranks 0..1 gave ['zigzag', 'contiguous']",
        "strategy": "same strategy; ranks 0..1 gave ['ring', 'ulysses']",
        "heads": "same H; ranks 0..1 gave [4, 2]",
        "lengths": "expects local lengths",
        "chunks": "same head_chunks; ranks 0..1 gave [2, 0]",
        "softcap": "same softcap; ranks 0..1 gave [1, 0]",
        "cp-strategy": "context_parallel: every rank must pass the same strategy",
        "nan-sink": "sinks must be finite logits, or -inf for a head with no sink; got nan for head 0",
    }
    for name, words_ in words.items():
        got = [r[name] for r in per_rank]
        assert got[0] == got[1], f"{name}: ranks raised different errors {got}"
        assert got[0][0] == "ValueError" and words_ in got[0][1], got[0]
    assert all(r["after"] is None for r in per_rank)
    # a rank whose own argument is wrong: every rank raises its error, naming it (no hang)
    for r in per_rank:
        assert r["bad-chunks"][0] == "ValueError", r["bad-chunks"]
        assert "ulysses_attention: rank 0's inputs: head_chunks must be" in r["bad-chunks"][1], r[
            "bad-chunks"
        ]


def _lonely(rank, path, strategy, results):
    torch.set_num_threads(1)
    store = dist.FileStore(path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=5))
    dist.barrier()  # both ranks are up
    if rank == 1:
        os._exit(0)  # dies without a word
    x = torch.randn(1, 2, 4, 4)
    fn = mhd.ring_attention if strategy == "ring" else mhd.ulysses_attention
    start = time.monotonic()
    try:
        fn(x, x, x)
        results.put(("no error", "", time.monotonic() - start))
    except Exception as exc:  # noqa: BLE001 -- sent to the test
        results.put((type(exc).__name__, str(exc), time.monotonic() - start))


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_a_dead_rank_makes_the_others_fail_within_the_timeout(tmp_path, strategy):
    ctx = torch.multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_lonely, args=(r, str(tmp_path / "store"), strategy, results)) for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        kind, message, elapsed = results.get(timeout=60)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert kind == "PeerLost", (kind, message)
    assert f"{strategy}_attention: a rank of the group did not answer within the group's timeout" in message
    assert "it died" in message and elapsed < 5 + 10


def test_context_parallel_refuses_bad_calls_by_name():
    model = mh.MultiHeadAttention(16, 4)
    with pytest.raises(
        ValueError, match=r"strategy must be one of \('ring', 'ulysses', 'hybrid'\), got 'tree'"
    ):
        with mhd.context_parallel(model, strategy="tree"):
            pass
    with pytest.raises(ValueError, match="layout must be one of"):
        with mhd.context_parallel(model, layout="spiral"):
            pass
    with pytest.raises(RuntimeError, match="needs an initialized torch.distributed process group"):
        with mhd.context_parallel(model):
            pass
    assert model.attention_fn is mh.attention  # nothing was installed


def _rotary_refused():
    model = torch.nn.Sequential(mh.MultiHeadAttention(16, 4, rotary=True))
    try:
        with mhd.context_parallel(model):
            return "entered"
    except ValueError as exc:
        return str(exc) if model[0].attention_fn is mh.attention else "not restored"


def test_context_parallel_refuses_per_call_positions():
    got = mhd.launch(_rotary_refused, 2, timeout=60, start_method="fork")
    assert all("cannot use rotary=True" in g for g in got), got
