"""The drop-in inside torch's own layers: nn.TransformerEncoderLayer/DecoderLayer, nn.TransformerEncoder and
nn.Transformer with every nn.MultiheadAttention swapped for multihead.compat.torch.MultiheadAttention give
torch's unconverted results in every mode (train, eval, no_grad, inference_mode), with padding masks, causal
masks, nested inputs and enable_nested_tensor; torch's fused encoder-layer kernel (which would bypass the
drop-in) is never called, and an open inspector sees every attention call.

float64 throughout, so "equal to torch" is checked to float64 precision (assert_close's float64 defaults).
"""

import contextlib
import copy
import pickle

import pytest
import torch
from torch import nn

from multihead import heads, viz
from multihead.compat.torch import MultiheadAttention, convert

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage"),
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True, but self.use_nested_tensor is False"),
]

E, H, F_, N, L, T = 16, 4, 32, 3, 6, 5
DT = torch.float64
MODES = {
    "train": (True, contextlib.nullcontext),
    "eval": (False, contextlib.nullcontext),
    "no_grad": (False, torch.no_grad),
    "inference_mode": (False, torch.inference_mode),
}
# padding on the right (torch's nested path needs left-aligned masks); the last row is not padded
KPM = torch.tensor([[False] * 4 + [True] * 2, [False] * 5 + [True], [False] * 6])


def _causal(n):
    return nn.Transformer.generate_square_subsequent_mask(n, dtype=DT)


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _layer(**kw):
    return nn.TransformerEncoderLayer(E, H, F_, dropout=0.0, dtype=DT, **{"batch_first": True, **kw})


# name -> (build the torch module, its inputs, the attention calls one forward makes)
CASES = {
    "encoder layer, padding": (lambda: _layer(), lambda: ((_x(N, L, E),), {"src_key_padding_mask": KPM}), 1),
    "encoder layer, pre-norm gelu, seq first, causal": (
        lambda: _layer(norm_first=True, activation="gelu", batch_first=False),
        lambda: ((_x(L, N, E),), {"src_mask": _causal(L), "is_causal": True}),
        1,
    ),
    "encoder, enable_nested_tensor, padding": (
        lambda: nn.TransformerEncoder(_layer(), 2, norm=nn.LayerNorm(E, dtype=DT), enable_nested_tensor=True),
        lambda: ((_x(N, L, E),), {"src_key_padding_mask": KPM}),
        2,
    ),
    "encoder, no nested tensor, padding and causal": (
        lambda: nn.TransformerEncoder(_layer(), 2, enable_nested_tensor=False),
        lambda: ((_x(N, L, E),), {"mask": _causal(L) < 0, "src_key_padding_mask": KPM}),
        2,
    ),
    "decoder layer, causal, memory padding": (
        lambda: nn.TransformerDecoderLayer(E, H, F_, dropout=0.0, batch_first=True, dtype=DT),
        lambda: (
            (_x(N, T, E), _x(N, L, E, seed=1)),
            {"tgt_mask": _causal(T), "tgt_is_causal": True, "memory_key_padding_mask": KPM},
        ),
        2,
    ),
    "nn.Transformer, seq first": (
        lambda: nn.Transformer(E, H, 2, 1, F_, dropout=0.0, dtype=DT),
        lambda: (
            (_x(L, N, E), _x(T, N, E, seed=1)),
            {"tgt_mask": _causal(T) < 0, "src_key_padding_mask": KPM, "memory_key_padding_mask": KPM},
        ),
        4,
    ),
}


def _padded(y):
    return y.to_padded_tensor(0.0) if y.is_nested else y


def _refuse_fused_kernel(*args, **kwargs):
    raise AssertionError("torch._transformer_encoder_layer_fwd was called around a drop-in")


def _run(model, training, ctx, args, kwargs):
    model.train(training)
    grad = ctx is contextlib.nullcontext
    args = tuple(a.detach().requires_grad_(grad) for a in args)
    with ctx():
        y = model(*args, **kwargs)
    out = _padded(y)
    if not grad:
        return out, ()
    params = [p for p in model.parameters() if p.requires_grad]
    return out, torch.autograd.grad(out.square().sum(), [*args, *params])


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(CASES))
def test_converted_layer_equals_torch_and_calls_the_drop_in(case, mode, monkeypatch):
    build, inputs, calls = CASES[case]
    training, ctx = MODES[mode]
    torch.manual_seed(0)
    ref = build()
    ours = convert(ref)
    args, kwargs = inputs()
    want, want_grads = _run(ref, training, ctx, args, kwargs)  # torch, its fused kernel allowed
    # the converted model must call the drop-in: torch's fused kernel raises if called
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", _refuse_fused_kernel)
    got, got_grads = _run(ours, training, ctx, args, kwargs)
    torch.testing.assert_close(got, want)
    assert len(got_grads) == len(want_grads)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)
    with viz.capture(ours) as cap:  # an open inspector sees every attention call, with weights
        _run(ours, training, ctx, args, kwargs)
    assert len(cap) == calls and all(r.weights.numel() for r in cap.records), cap.names()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_nested_input_equals_torch_on_each_sequence(layout, mode, monkeypatch):
    """A nested batch through a converted encoder layer: each sequence's output is torch's layer on that
    sequence alone, in every mode (torch itself takes nested inputs only in eval without grad, strided)."""
    training, ctx = MODES[mode]
    torch.manual_seed(0)
    ref = _layer().train(training)
    ours = convert(ref)
    seqs = [_x(n, E, seed=n) for n in (4, 6, 1)]
    x = torch.nested.nested_tensor(seqs, layout=layout)  # (N, L*, E)
    with torch.no_grad():
        want = [ref(t[None])[0] for t in seqs]  # (L_i, E) each
        want_nested = ref(x) if layout == torch.strided and not training else None
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", _refuse_fused_kernel)
    with ctx():
        got = ours(x)
    assert got.is_nested and got.layout == layout
    for g, w in zip(got.unbind(), want, strict=True):
        torch.testing.assert_close(g, w)
    if want_nested is not None:
        torch.testing.assert_close(got.to_padded_tensor(0.0), want_nested.to_padded_tensor(0.0))


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_drop_in_set_by_hand_in_eval_is_called_and_masks_heads(ctx):
    """The issue's case: a drop-in assigned into a torch layer, eval under no_grad. It used to raise
    AttributeError (merge_masks); now it runs, and heads.masked(head 1) equals torch's layer with head 1's
    columns of out_proj zeroed."""
    torch.manual_seed(0)
    plain = _layer().eval()
    layer, zeroed = copy.deepcopy(plain), copy.deepcopy(plain)
    layer.self_attn = MultiheadAttention.from_torch(layer.self_attn)
    d = E // H
    with torch.no_grad():
        zeroed.self_attn.out_proj.weight[:, d : 2 * d] = 0.0  # head 1 contributes nothing
    x = _x(N, L, E)
    with ctx():
        torch.testing.assert_close(layer(x, src_key_padding_mask=KPM), plain(x, src_key_padding_mask=KPM))
        with heads.masked(layer, {"self_attn": [1]}):
            got = layer(x, src_key_padding_mask=KPM)
        torch.testing.assert_close(got, zeroed(x, src_key_padding_mask=KPM))


def test_the_guard_survives_copies_and_old_pickles():
    """The no-op pre-hook that keeps torch's fused kernel away travels with deepcopy and pickle, and a drop-in
    pickled without it (an older version) gets it back when unpickled."""
    from multihead.compat.torch.attention import _always_call_me

    m = MultiheadAttention(E, H, batch_first=True)
    assert list(m._forward_pre_hooks.values()) == [_always_call_me]
    assert list(copy.deepcopy(m)._forward_pre_hooks.values()) == [_always_call_me]
    m._forward_pre_hooks.clear()  # as an older version pickled it
    assert list(pickle.loads(pickle.dumps(m))._forward_pre_hooks.values()) == [_always_call_me]
