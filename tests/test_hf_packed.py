"""Padding-free batches on multihead: packed rows (positions that restart) give the padded batch's loss,
and reach the attention as sequence ids, not as a dense (L, L) mask.

Tiny random Llama (no hub access).
"""

import copy

import pytest
import torch

T = pytest.importorskip("transformers")

from multihead.integrations import transformers as mhtf  # noqa: E402

NAME = mhtf.register()
V = 50
LENGTHS = (5, 3, 6)


def _config(config_class, **extra):
    """A tiny decoder config: 2 layers, 4 query heads over 2 key/value heads."""
    sizes = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, max_position_embeddings=32)
    return config_class(vocab_size=V, num_attention_heads=4, num_key_value_heads=2, **sizes, **extra)


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    config = _config(T.LlamaConfig)
    return T.AutoModelForCausalLM.from_config(config, attn_implementation=NAME).eval()


def _rows():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, V, (n,), generator=g).tolist() for n in LENGTHS]


def _padded(rows):
    """Right-padded batch (B, max L) with its mask and -100 labels on padding."""
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    keep = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        keep[i, : len(r)] = 1
    return {"input_ids": ids, "attention_mask": keep, "labels": ids.masked_fill(keep == 0, -100)}


@pytest.mark.parametrize(
    "flash_kwargs, use_cache, mask_kind",
    [(False, False, "function"), (True, False, "function"), (False, True, "none")],
)
def test_packed_batch_loss_equals_padded_batch_loss(llama, flash_kwargs, use_cache, mask_kind):
    """transformers builds the packed mask function without a cache; with one (eval's default) it skips
    its packing check and passes no mask, and multihead reads the restarting positions itself."""
    rows = _rows()
    collate = T.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    packed = collate([{"input_ids": r} for r in rows])
    packed["use_cache"] = use_cache
    assert packed["input_ids"].shape == (1, sum(LENGTHS))
    masks = []
    hook = llama.model.layers[0].self_attn.register_forward_pre_hook(
        lambda _m, _a, kw: masks.append(kw.get("attention_mask")), with_kwargs=True
    )
    try:
        with torch.no_grad():
            want = llama(**_padded(rows)).loss
            got = llama(**packed).loss
    finally:
        hook.remove()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert isinstance(masks[0], torch.Tensor)  # the padded batch: a (B, 1, L, L) bool mask
    if mask_kind == "function":  # packed: no dense mask built
        assert callable(masks[1]) and not isinstance(masks[1], torch.Tensor)
    else:
        assert masks[1] is None

    eager = copy.deepcopy(llama)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        torch.testing.assert_close(eager(**_padded(rows)).loss, want, rtol=0, atol=1e-5)
        if not use_cache:  # eager agrees where transformers itself sees the packing
            torch.testing.assert_close(eager(**packed).loss, got, rtol=0, atol=1e-5)


def test_packed_batch_gradients_equal_padded_batch_gradients(llama):
    rows = _rows()
    packed = T.DataCollatorWithFlattening()([{"input_ids": r} for r in rows])
    model = copy.deepcopy(llama).train()  # use_cache stays on: multihead separates the rows itself
    grads = []
    for batch in (_padded(rows), packed):
        model.zero_grad()
        model(**batch).loss.backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-5)


def test_segments_from_positions_follow_restarts():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]])
    want = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3]])
    assert torch.equal(mhtf.segments_from_positions(positions), want)


def test_mask_interface_keeps_dense_masks_where_nothing_is_packed():
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    kw = dict(batch_size=2, q_length=5, kv_length=5, mask_function=causal_mask_function)
    # plain causal, skip allowed: None (the attention function applies causal itself), as sdpa_mask
    assert mhtf.mask_interface(**kw) is None and sdpa_mask(**kw) is None
    # a model that asks for the materialised mask (to combine it) gets the tensor
    dense = mhtf.mask_interface(**kw, allow_is_causal_skip=False)
    assert torch.equal(dense, sdpa_mask(**kw, allow_is_causal_skip=False))


def test_a_forward_passes_packing_is_found_once_and_found_again_when_positions_change():
    """The layers of one forward pass share ``position_ids``: their sequence ids are computed once, and again
    for a new tensor or after the same tensor changed in place (also for an inference tensor)."""
    from multihead.integrations.transformers.attention import _segments

    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    first = _segments({"position_ids": positions}, 2, 6)
    assert torch.equal(first, torch.tensor([[0, 0, 0, 1, 1, 1]] * 2))
    assert _segments({"position_ids": positions}, 2, 6) is first  # the next layer: kept
    assert _segments({"position_ids": positions}, 1, 6).shape == (1, 6)  # another batch size: computed
    positions[0, 3:] = torch.tensor([3, 4, 5])  # in place: one sequence now
    assert _segments({"position_ids": positions}, 1, 6) is None
    assert _segments({"position_ids": torch.tensor([[0, 1, 0, 1, 2, 3]])}, 1, 6).tolist() == [
        [0, 0, 1, 1, 1, 1]
    ]
    with torch.inference_mode():
        restarts = torch.tensor([[0, 1, 2, 0, 1, 0]])
        assert _segments({"position_ids": restarts}, 1, 6).tolist() == [[0, 0, 0, 1, 1, 2]]
        restarts[0, 5] = 2
        assert _segments({"position_ids": restarts}, 1, 6).tolist() == [[0, 0, 0, 1, 1, 1]]
    starts = torch.tensor([0, 6])  # cu_seq_lens_q of one sequence: nothing to separate
    assert _segments({"cu_seq_lens_q": starts}, 1, 6) is None
    assert _segments({"cu_seq_lens_q": torch.tensor([0, 2, 6])}, 1, 6).tolist() == [[0, 0, 1, 1, 1, 1]]


def _sliding(config_class, **extra):
    return _config(config_class, head_dim=8, sliding_window=3, **extra)


@pytest.mark.parametrize(
    "family",
    [
        "mistral",  # every layer a window: transformers builds a dense window mask when a cache is on
        "gpt_oss",  # alternating windows and sinks: transformers never looks for packing (no position_ids)
    ],
)
@pytest.mark.parametrize("use_cache", [False, True])
def test_packed_sliding_window_rows_stay_apart(family, use_cache):
    config = {
        "mistral": lambda: _sliding(T.MistralConfig),
        "gpt_oss": lambda: _sliding(T.GptOssConfig, num_local_experts=4, num_experts_per_tok=2),
    }[family]()
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation=NAME).eval()
    rows = _rows()
    packed = T.DataCollatorWithFlattening()([{"input_ids": r} for r in rows])
    with torch.no_grad():
        want = model(**_padded(rows)).loss
        got = model(**packed, use_cache=use_cache).loss
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
