"""Inspectors compose: any nesting of capture, head masks, importance gates and user inspectors applies
all of them, outermost first, in eager and compiled code, per thread and per asyncio task.

Every expectation is computed without inspectors: masking head h equals zeroing its columns of the
output projection, a user inspector scaling head h by s equals scaling those columns by s, importance
equals the per-example gradient through those columns (test_heads' identity), and a capture equals the
weights a spying ``attention_fn`` gets from ``multihead.attention(..., return_weights=True)``.
"""

import asyncio
import copy
import threading
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import multihead as mh
from multihead import heads, viz
from multihead.nn import seam

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class Scale(seam.Inspector):
    """A user inspector: multiplies head h of every module by ``factors[h]``; keeps the heads it got."""

    def __init__(self, factors):
        self.factors, self.seen = torch.tensor(factors, dtype=torch.float64), []

    def on_heads(self, module, heads, weights):
        self.seen.append(heads.detach().clone())
        return heads * self.factors.to(heads.dtype)[None, :, None, None]  # (B, H, Lq, Dv) * (1, H, 1, 1)


FACTORS = [0.5, 2.0, -1.0, 1.5]


def spy_on(model):
    """Replace every attention module's ``attention_fn`` by a spy: ``[(name, heads, weights)]`` per call."""
    calls = []

    def make(name):
        def spy(q, k, v, *, return_weights=False, **kwargs):
            out, w = mh.attention(q, k, v, return_weights=True, **kwargs)  # (B, H, Lq, Dv), (B, H, Lq, Lk)
            calls.append((name, out.detach().clone(), w.detach().clone()))
            return mh.AttentionOutput(out, w) if return_weights else out

        return spy

    for name, m in heads.attention_modules(model).items():
        m.attention_fn = make(name)
    return calls


def scale_columns(model, per_module):
    """Multiply head h's columns of every listed module's out_proj by ``per_module[name][h]``."""
    with torch.no_grad():
        for name, factors in per_module.items():
            m = heads.attention_modules(model)[name]
            w = m.out_proj.weight  # (O, H*Dv)
            w.copy_((w.unflatten(1, (m.num_heads, m.v_head_dim)) * factors[None, :, None]).flatten(1))


# ------------------------------------------------------------------------------------------------
# The models and the four kinds of inspector
# ------------------------------------------------------------------------------------------------


@dataclass
class Setup:
    model: nn.Module  # what the inspectors are given
    forward: Callable[[nn.Module, slice], torch.Tensor]  # one batch (or a slice of its examples)
    target: torch.Tensor  # of the output, for the importance loss
    spec: dict[str, list[int]]  # heads to mask
    batch: int = 2


def _mha():
    torch.manual_seed(0)
    m = mh.MultiHeadAttention(16, 4, kv_heads=2).double().eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)  # (B, L, E)
    return Setup(
        m, lambda mod, sl: mod(x[sl], causal=True), torch.randn(2, 5, 16, dtype=torch.float64), {"": [0, 3]}
    )


def _transformer():
    torch.manual_seed(0)
    model = mh.Transformer(
        11, 11, d_model=16, num_heads=4, num_encoder_layers=1, num_decoder_layers=1, d_ff=32, dropout=0.0
    )
    model = model.double().eval()
    src, tgt = torch.randint(3, 11, (2, 6)), torch.randint(3, 11, (2, 5))  # (B, S), (B, T) token ids
    spec = {"encoder.layers.0.self_attn": [1], "decoder.layers.0.cross_attn": [0, 2]}
    target = torch.randn(2, 5, 11, dtype=torch.float64)
    return Setup(model, lambda mod, sl: mod(src[sl], tgt[sl]), target, spec)


MODELS = {"mha": _mha, "transformer": _transformer}
KINDS = ("capture", "masked", "importance", "user")
PAIRS = [(a, b) for a in KINDS for b in KINDS if a != b]  # ordered: (outer, inner)


def _loss(s, out, sl=slice(None)):
    return F.mse_loss(out, s.target[sl])


def run_nested(s, order, under_test):
    """Run ``under_test`` (the model, or it compiled) inside the inspectors ``order`` (outermost first)."""
    got = {}

    def body():
        out = s.forward(under_test, slice(None))
        got["out"] = out.detach()
        return _loss(s, out)

    def wrap(kind, inner):
        if kind == "importance":

            def score():
                got["scores"] = heads.importance(s.model, [None], lambda m, _: inner(), normalize=False)

            return score
        if kind == "capture":
            block = viz.capture(s.model)
        elif kind == "masked":
            block = heads.masked(s.model, s.spec)
        else:
            block = seam.inspecting(Scale(FACTORS))

        def within():
            with block as value:
                got[kind] = value
                return inner()

        return within

    for kind in reversed(order):
        body = wrap(kind, body)
    body()
    return got


def expected(s, order):
    """The same computation without inspectors: masks and scales moved into out_proj's columns."""
    ref = copy.deepcopy(s.model)
    names = list(heads.attention_modules(ref))
    gates = {name: torch.ones(heads.head_counts(ref)[name], dtype=torch.float64) for name in names}
    if "masked" in order:
        for name, idx in s.spec.items():
            gates[name][idx] = 0.0
    factors = {name: torch.tensor(FACTORS, dtype=torch.float64) if "user" in order else 1.0 for name in names}
    scale_columns(ref, {name: gates[name] * factors[name] for name in names})

    # importance of that model: per-example gradient through each head's out_proj columns (test_heads)
    scores = {name: [] for name in names}
    for b in range(s.batch):
        ref.zero_grad()
        _loss(s, s.forward(ref, slice(b, b + 1)), slice(b, b + 1)).backward()
        for name, m in heads.attention_modules(ref).items():
            prod = m.out_proj.weight.grad * m.out_proj.weight.detach()  # (O, H*Dv)
            scores[name].append(prod.unflatten(1, (m.num_heads, m.v_head_dim)).sum(dim=(0, 2)).abs())  # (H,)
    calls = spy_on(ref)
    with torch.no_grad():
        out = s.forward(ref, slice(None))
    # the user inspector sees the heads as the inspectors entered before it left them
    masks_user = "masked" in order and "user" in order and order.index("masked") < order.index("user")
    user_gates = gates if masks_user else {}
    seen = [h * user_gates[n][None, :, None, None] if n in user_gates else h for n, h, _ in calls]
    return {
        "out": out,
        "weights": [(n, w) for n, _, w in calls],
        "seen": seen,
        "scores": {name: torch.stack(v).mean(0) for name, v in scores.items()},
    }


def check(s, order, got):
    want = expected(s, order)
    torch.testing.assert_close(got["out"], want["out"])
    plain = expected(s, ())["out"]
    if "masked" in order or "user" in order:
        assert not torch.allclose(got["out"], plain)  # the gates did change the output
    if "capture" in order:
        cap = got["capture"]
        assert [r.name for r in cap.records] == [n for n, _ in want["weights"]]
        for r, (_, w) in zip(cap.records, want["weights"]):
            torch.testing.assert_close(r.weights, w)
    if "user" in order:
        seen = got["user"].seen
        assert len(seen) == len(want["seen"])
        for a, b in zip(seen, want["seen"]):
            torch.testing.assert_close(a, b)
    if "importance" in order:
        assert got["scores"].keys() == want["scores"].keys()
        for name, score in got["scores"].items():
            torch.testing.assert_close(score.double(), want["scores"][name], rtol=1e-5, atol=1e-9)
        if "masked" in order:
            for name, idx in s.spec.items():
                assert got["scores"][name][idx].abs().max() == 0  # a masked head cannot matter


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("outer, inner", PAIRS)
def test_every_pair_composes(model, outer, inner):
    s = MODELS[model]()
    check(s, (outer, inner), run_nested(s, (outer, inner), s.model))


@pytest.mark.parametrize("outer, inner", PAIRS)
def test_every_pair_composes_compiled(outer, inner):
    """The same on a compiled module; without importance (its gates need grad) in one graph."""
    s = _mha()
    full = "importance" not in (outer, inner)
    compiled = torch.compile(s.model, fullgraph=full, backend="eager")
    check(s, (outer, inner), run_nested(s, (outer, inner), compiled))
    if full:  # and leaving the blocks leaves the compiled model as it was
        plain = expected(s, ())["out"]
        with torch.no_grad():
            torch.testing.assert_close(s.forward(compiled, slice(None)), plain)


@pytest.mark.parametrize("compiled", [False, True])
def test_three_deep_and_all_four(compiled):
    s = _mha() if compiled else _transformer()
    under = torch.compile(s.model, backend="eager") if compiled else s.model
    order = ("masked", "capture", "user", "importance")
    check(s, order, run_nested(s, order, under))


# ------------------------------------------------------------------------------------------------
# Several of one kind
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compiled", [False, True])
def test_nested_captures_both_record(compiled):
    s = _mha() if compiled else _transformer()
    under = torch.compile(s.model, fullgraph=True, backend="eager") if compiled else s.model
    want = expected(s, ())["weights"]
    with torch.no_grad(), viz.capture(s.model) as outer:
        s.forward(under, slice(None))
        with viz.capture(s.model) as inner:
            s.forward(under, slice(None))
    assert len(outer) == 2 * len(want) and len(inner) == len(want)
    for r, (n, w) in zip(inner.records, want):
        assert r.name == n
        torch.testing.assert_close(r.weights, w)
    for r, (n, w) in zip(outer.records, want + want):
        assert r.name == n
        torch.testing.assert_close(r.weights, w)


def test_nested_masks_mask_the_union():
    s = _transformer()
    a = {"encoder.layers.0.self_attn": [1]}
    b = {"encoder.layers.0.self_attn": [2], "decoder.layers.0.cross_attn": [0, 2]}
    ref = copy.deepcopy(s.model)
    gates = {
        "encoder.layers.0.self_attn": torch.tensor([1.0, 0, 0, 1]),
        "decoder.layers.0.cross_attn": torch.tensor([0.0, 1, 0, 1]),
    }
    scale_columns(ref, {k: g.double() for k, g in gates.items()})
    with torch.no_grad(), heads.masked(s.model, a), heads.masked(s.model, b):
        got = s.forward(s.model, slice(None))
    with torch.no_grad():
        torch.testing.assert_close(got, s.forward(ref, slice(None)))


class Shift(seam.Inspector):
    """Adds a constant to every head's output: with Scale, the order of the two is visible."""

    def __init__(self, c):
        self.c = c

    def on_heads(self, module, heads, weights):
        return heads + self.c


@pytest.mark.parametrize("shift_first", [True, False])
@pytest.mark.parametrize("compiled", [False, True])
def test_outermost_first(shift_first, compiled):
    """Inspectors apply in the order their blocks were entered: the outer one sees the raw heads."""
    s = _mha()
    under = torch.compile(s.model, fullgraph=True, backend="eager") if compiled else s.model
    ref = copy.deepcopy(s.model)
    calls = spy_on(ref)
    with torch.no_grad():
        s.forward(ref, slice(None))
    ((_, raw, _),) = calls  # (B, H, Lq, Dv)
    factors = torch.tensor(FACTORS, dtype=torch.float64)[None, :, None, None]
    heads_after = (raw + 0.25) * factors if shift_first else raw * factors + 0.25
    m = s.model
    want = F.linear(heads_after.transpose(1, 2).flatten(2), m.out_proj.weight, m.out_proj.bias)  # (B, L, E)
    shift, scale = Shift(0.25), Scale(FACTORS)
    first, second = (shift, scale) if shift_first else (scale, shift)
    with torch.no_grad(), seam.inspecting(first), seam.inspecting(second):
        assert seam.active() == (first, second) and seam.current() is second
        got = s.forward(under, slice(None))
    assert seam.active() == () and seam.current() is None
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(scale.seen[0], raw if not shift_first else raw + 0.25)


def test_inspecting_refuses_what_is_not_an_inspector():
    with pytest.raises(TypeError, match="inspector must be a multihead.nn.seam.Inspector"):
        with seam.inspecting(lambda heads: heads):
            pass


# ------------------------------------------------------------------------------------------------
# Threads and asyncio tasks: each sees only its own inspectors, eager and compiled
# ------------------------------------------------------------------------------------------------


@contextmanager
def entered(blocks):
    """Enter ``blocks`` (context managers), the first outermost; yields what each gave."""
    with ExitStack() as stack:
        yield [stack.enter_context(b) for b in blocks]


def _per_worker_expectations(s):
    plain = expected(s, ())["out"]
    masked = expected(s, ("masked",))["out"]
    scaled_and_masked = expected(s, ("masked", "user"))["out"]
    return plain, masked, scaled_and_masked


def test_threads_see_only_their_own_inspectors():
    """Thread A masks, thread B masks and scales, thread C inspects nothing; they take turns on a shared
    compiled module and an eager one while all their blocks are open (barriers fix the order)."""
    s = _mha()
    compiled = torch.compile(s.model, fullgraph=True, backend="eager")
    plain, masked, scaled_and_masked = _per_worker_expectations(s)
    opened, turns = threading.Barrier(3), [threading.Event() for _ in range(4)]
    results, errors = {}, []

    def worker(i, blocks):
        try:
            with entered(blocks()):
                opened.wait(timeout=60)
                turns[i].wait(timeout=60)
                with torch.no_grad():
                    results[i] = (s.forward(compiled, slice(None)), s.forward(s.model, slice(None)))
                turns[i + 1].set()
                turns[3].wait(timeout=60)  # keep the blocks open until every thread ran
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
            for t in turns:
                t.set()

    blocks = {
        0: lambda: [heads.masked(s.model, s.spec)],
        1: lambda: [heads.masked(s.model, s.spec), seam.inspecting(Scale(FACTORS))],
        2: lambda: [],
    }
    threads = [threading.Thread(target=worker, args=(i, blocks[i])) for i in range(3)]
    for t in threads:
        t.start()
    turns[0].set()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for i, want in enumerate([masked, scaled_and_masked, plain]):
        for got in results[i]:
            torch.testing.assert_close(got, want)
    assert seam.active() == ()


def test_asyncio_tasks_see_only_their_own_inspectors():
    """Two tasks open different nested inspectors, then take turns on a compiled and an eager module."""
    s = _mha()
    compiled = torch.compile(s.model, fullgraph=True, backend="eager")
    plain, masked, scaled_and_masked = _per_worker_expectations(s)

    async def task(make, opened, go, done):
        with entered(make()):
            with viz.capture(s.model) as cap:
                opened.set()
                await go.wait()
                with torch.no_grad():
                    out = (s.forward(compiled, slice(None)), s.forward(s.model, slice(None)))
                done.set()
                await asyncio.sleep(0)
        return out, cap

    async def main():
        events = [asyncio.Event() for _ in range(6)]
        a = asyncio.create_task(
            task(lambda: [heads.masked(s.model, s.spec)], events[0], events[2], events[3])
        )
        b = asyncio.create_task(
            task(
                lambda: [heads.masked(s.model, s.spec), seam.inspecting(Scale(FACTORS))],
                events[1],
                events[3],
                events[4],
            )
        )
        await events[0].wait()
        await events[1].wait()  # both tasks have their blocks open
        with torch.no_grad():
            mine = (s.forward(compiled, slice(None)), s.forward(s.model, slice(None)))
        events[2].set()
        return mine, await a, await b

    mine, (out_a, cap_a), (out_b, cap_b) = asyncio.run(main())
    for got in mine:
        torch.testing.assert_close(got, plain)
    for got in out_a:
        torch.testing.assert_close(got, masked)
    for got in out_b:
        torch.testing.assert_close(got, scaled_and_masked)
    assert len(cap_a) == len(cap_b) == 2  # each capture saw its own task's two calls
    assert seam.active() == ()


# ------------------------------------------------------------------------------------------------
# Hugging Face models on the seam
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mask_first", [True, False])
def test_hugging_face_model_masked_and_captured(mask_first):
    """GPT-2 on multihead, head 1 of layer 0 masked and every layer captured, in both orders, equals the
    eager GPT-2 with that head's slice zeroed before c_proj (a hook) and its output_attentions."""
    T = pytest.importorskip("transformers")
    from multihead.integrations import transformers as mhtf

    name = mhtf.register()
    config = T.GPT2Config(
        vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=16, bos_token_id=1, eos_token_id=2
    )
    torch.manual_seed(0)
    eager = T.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ours = T.AutoModelForCausalLM.from_config(config, attn_implementation=name).eval()
    ours.load_state_dict(eager.state_dict())
    ids = torch.randint(3, 50, (2, 7))

    def zero_head(_, args):
        (x,) = args
        x = x.clone()
        x[..., 8:16] = 0  # head 1 of 4, width 32
        return (x,)

    handle = eager.get_submodule("transformer.h.0.attn.c_proj").register_forward_pre_hook(zero_head)
    try:
        with torch.no_grad():
            want = eager(ids, output_attentions=True)
    finally:
        handle.remove()
    blocks = [heads.masked(ours, {"transformer.h.0.attn": [1]}), viz.capture(ours)]
    with torch.no_grad(), entered(blocks if mask_first else blocks[::-1]) as values:
        got = ours(ids).logits
    cap = values[1 if mask_first else 0]
    torch.testing.assert_close(got, want.logits, rtol=0, atol=1e-5)
    assert cap.names() == ["transformer.h.0.attn", "transformer.h.1.attn"]
    for n, w in zip(cap.names(), want.attentions):
        torch.testing.assert_close(cap.get(n), w, rtol=0, atol=1e-5)
    assert not torch.allclose(want.attentions[1], eager(ids, output_attentions=True).attentions[1])
