"""Hugging Face models a user brings that the head tools must see: attention modules that call transformers'
attention interface but are recorded only through a wrapper (T5's ``T5LayerSelfAttention``), and
cross-attention named the way those families name it.

Tiny random models only (no hub access).
"""

import copy

import pytest
import torch

T = pytest.importorskip("transformers")

from multihead import heads, viz  # noqa: E402
from multihead.integrations import transformers as mhtf  # noqa: E402

NAME = mhtf.register()
V = 40


def _t5_pair():
    config = T.T5Config(
        vocab_size=V,
        d_model=16,
        d_kv=4,
        d_ff=24,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        decoder_start_token_id=1,
    )
    return _pair(T.T5ForConditionalGeneration, config)


def _pair(model_class, config):
    """(eager, multihead) models of ``model_class`` with the same random weights, in eval mode."""
    torch.manual_seed(0)
    eager = model_class._from_config(copy.deepcopy(config), attn_implementation="eager")
    ours = model_class._from_config(copy.deepcopy(config), attn_implementation=NAME)
    ours.load_state_dict(eager.state_dict())
    return eager.eval(), ours.eval()


def test_t5_attention_reached_through_a_wrapper_is_captured_with_its_kind():
    eager, ours = _t5_pair()
    ids, dec = torch.randint(3, V, (2, 6)), torch.randint(3, V, (2, 4))
    names = {
        "encoder.block.0.layer.0.SelfAttention": "encoder self",
        "decoder.block.0.layer.0.SelfAttention": "decoder self",
        "decoder.block.0.layer.1.EncDecAttention": "cross",
    }
    assert heads.head_counts(ours) == dict.fromkeys(names, 4)
    with torch.no_grad():
        want = eager(input_ids=ids, decoder_input_ids=dec, output_attentions=True)
        with viz.capture(ours) as cap:
            ours(input_ids=ids, decoder_input_ids=dec)
    assert {n: cap.kind(n) for n in cap.names()} == names
    expected = (want.encoder_attentions[0], want.decoder_attentions[0], want.cross_attentions[0])
    for name, w in zip(names, expected):
        torch.testing.assert_close(cap.get(name), w, rtol=0, atol=1e-6)


def test_a_decoder_whose_self_attention_says_not_causal_still_gets_its_causal_mask():
    """PEGASUS-X builds its decoder's self-attention with is_causal=False and relies on the causal mask; it
    declares no sdpa support, so transformers never vouched that a skipped mask plus is_causal is right."""
    config = T.PegasusXConfig(
        vocab_size=V,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=24,
        decoder_ffn_dim=24,
        max_position_embeddings=32,
        block_size=8,
        num_global_tokens=2,
        pad_token_id=0,
        decoder_start_token_id=1,
    )
    eager, ours = _pair(T.PegasusXForConditionalGeneration, config)
    ids, dec = torch.randint(3, V, (2, 8)), torch.randint(3, V, (2, 5))
    with torch.no_grad():
        want = eager(input_ids=ids, decoder_input_ids=dec).logits
        got = ours(input_ids=ids, decoder_input_ids=dec).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        kw = dict(max_new_tokens=4, do_sample=False, decoder_start_token_id=1, pad_token_id=0)
        assert ours.generate(ids, **kw).tolist() == eager.generate(ids, **kw).tolist()


def test_beam_search_over_a_left_padded_batch_past_the_window_equals_eager():
    config = T.MistralConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=3,
        pad_token_id=0,
    )
    eager, ours = _pair(T.MistralForCausalLM, config)
    ids = torch.randint(3, V, (2, 6))
    keep = torch.ones(2, 6, dtype=torch.long)
    keep[0, :2] = 0  # left padding; prompt and output both longer than the window
    kw = dict(attention_mask=keep, max_new_tokens=5, do_sample=False, num_beams=3, pad_token_id=0)
    with torch.no_grad():
        assert ours.generate(ids, **kw).tolist() == eager.generate(ids, **kw).tolist()


def test_swin_heads_are_its_attention_modules_not_the_recorded_stages():
    """Swin records its weights from SwinStage (a stage of blocks, num_heads a list in the config): the head
    tools act on the modules that call the attention, one head count per window attention."""
    config = T.SwinConfig(
        image_size=8, patch_size=2, embed_dim=8, depths=[1, 1], num_heads=[2, 4], window_size=2
    )
    eager, ours = _pair(T.SwinModel, config)
    names = {"encoder.layers.0.blocks.0.attention": 2, "encoder.layers.1.blocks.0.attention": 4}
    assert heads.head_counts(ours) == names
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        want = eager(pixel_values=x, output_attentions=True).attentions
        with viz.capture(ours) as cap:
            ours(pixel_values=x)
    assert cap.names() == list(names)
    for name, w in zip(names, want):
        torch.testing.assert_close(cap.get(name), w, rtol=0, atol=1e-6)
