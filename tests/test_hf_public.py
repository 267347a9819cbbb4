"""The Hugging Face integration on public ground: refusals by name, pruned checkpoints without patches,
and one test per private transformers internal that names the version when it changes.

Tiny random models only (no hub access).
"""

import threading
import warnings

import pytest
import torch

T = pytest.importorskip("transformers")

from multihead import heads, viz  # noqa: E402
from multihead.integrations import transformers as mhtf  # noqa: E402

NAME = mhtf.register()
V = 50
VERSION = f"transformers {T.__version__}"


def _git_config():
    return T.GitConfig(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=32,
        bos_token_id=1,
        eos_token_id=2,
        vision_config=dict(
            hidden_size=16, intermediate_size=20, num_hidden_layers=1, num_attention_heads=2, image_size=8
        ),
    )


def _llama_config(**kw):
    base = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return T.LlamaConfig(**{**base, **kw})


def _bert_config():
    return T.BertConfig(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=32,
    )


# ------------------------------------------------------------------------------------------------
# Refusals: an eager-only family is refused by name, never run with the wrong mask
# ------------------------------------------------------------------------------------------------


def test_git_switched_to_multihead_is_refused_by_name_on_first_forward():
    torch.manual_seed(0)
    model = T.GitForCausalLM(_git_config()).eval()  # eager: the only attention GIT's text stack has
    ids = torch.randint(3, V, (1, 5))
    model.set_attn_implementation(NAME)  # transformers accepts it (no hook for custom implementations)
    with pytest.raises(
        ValueError, match="GitForCausalLM.*cannot run on multihead.*attn_implementation='eager'"
    ):
        model(ids)
    with pytest.raises(ValueError, match="GitForCausalLM cannot run on multihead"):
        mhtf.check_model(model)
    with pytest.raises(ValueError, match="GitForCausalLM cannot run on multihead"):
        viz.capture(model).__enter__()


def test_decoder_only_eager_family_outside_automodel_is_refused_on_first_forward():
    """TrOCR's config has no AutoModel entry: the family is found from the classes built on its config.
    (``set_attn_implementation`` leaves TrOCR on eager -- transformers sees it cannot switch -- but
    building it on multihead does not.)"""
    config = T.TrOCRConfig(
        vocab_size=V, d_model=32, decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=37
    )
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation=NAME).eval()
    with pytest.raises(ValueError, match="TrOCRForCausalLM.*cannot run on multihead"):
        model(torch.randint(3, V, (1, 4)))


def test_git_is_refused_by_from_pretrained(tmp_path):
    T.GitForCausalLM(_git_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GitForCausalLM cannot run on multihead"):
        mhtf.from_pretrained(T.AutoModelForCausalLM, tmp_path, attn_implementation=NAME)
    eager = mhtf.from_pretrained(T.AutoModelForCausalLM, tmp_path, attn_implementation="eager")
    assert type(eager).__name__ == "GitForCausalLM"  # only multihead is refused


@pytest.mark.parametrize(
    "config",
    [
        _llama_config,
        _bert_config,
        lambda: T.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=4, n_positions=32),
        lambda: T.BartConfig(
            vocab_size=V,
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=37,
            decoder_ffn_dim=37,
            max_position_embeddings=32,
        ),
    ],
    ids=["llama", "bert", "gpt2", "bart"],
)
def test_supported_families_pass_the_check(config):
    model = T.AutoModel.from_config(config(), attn_implementation=NAME)
    mhtf.check_model(model)  # no error
    assert all(mhtf.unsupported(type(m)) is None for m in model.modules() if isinstance(m, T.PreTrainedModel))


# Families whose attention called sdpa itself in some transformers release; each release moves some of
# them onto AttentionInterface (Falcon and GPT-J did in 5.25), so the test picks one by reading its code.
_SELF_COMPUTING_CANDIDATES = (
    "FalconForCausalLM",
    "GPTJForCausalLM",
    "GPTNeoForCausalLM",
    "Data2VecVisionModel",
    "BarkCausalModel",
)


def _self_computing_class() -> type:
    """A model class that declares sdpa but whose modeling file never names ``ALL_ATTENTION_FUNCTIONS``
    (so its modules compute attention themselves), judged from the source, not from the adapter's check."""
    import importlib
    import inspect

    for name in _SELF_COMPUTING_CANDIDATES:
        cls = getattr(T, name, None)
        if cls is None or not getattr(cls, "_supports_sdpa", False):
            continue
        source = inspect.getsource(importlib.import_module(cls.__module__))
        if "ALL_ATTENTION_FUNCTIONS" not in source and "scaled_dot_product_attention" in source:
            return cls
    pytest.fail(
        f"{VERSION}: none of {list(_SELF_COMPUTING_CANDIDATES)} computes attention itself any more; "
        f"name another such family in _SELF_COMPUTING_CANDIDATES"
    )


def test_eager_only_classes_are_named_unsupported():
    assert "eager attention" in mhtf.unsupported(T.GitForCausalLM)
    own = _self_computing_class()  # sdpa, not via the interface
    assert "compute attention themselves" in mhtf.unsupported(own), own.__name__
    assert mhtf.unsupported(T.LlamaForCausalLM) is None


# ------------------------------------------------------------------------------------------------
# Pruned checkpoints: no class-wide patch, several threads, Auto and task classes
# ------------------------------------------------------------------------------------------------


def _pruned(auto, config, spec, seed):
    torch.manual_seed(seed)
    model = auto.from_config(config, attn_implementation=NAME).eval()
    return heads.prune(model, spec)


def test_two_pruned_folders_load_concurrently_from_threads(tmp_path):
    small_a = _pruned(T.AutoModelForCausalLM, _llama_config(), {"model.layers.0.self_attn": [1, 2]}, 0)
    small_b = _pruned(T.AutoModelForCausalLM, _llama_config(), {"model.layers.1.self_attn": [0, 1, 3]}, 1)
    small_a.save_pretrained(tmp_path / "a")
    small_b.save_pretrained(tmp_path / "b")
    post_init = T.PreTrainedModel.post_init
    barrier = threading.Barrier(4)
    loaded, errors = {}, []

    def load(key, rounds=3):
        try:
            barrier.wait()
            for _ in range(rounds):
                loaded.setdefault(key, []).append(
                    mhtf.from_pretrained(T.AutoModelForCausalLM, tmp_path / key[0], attn_implementation=NAME)
                )
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(k,)) for k in ("a1", "b1", "a2", "b2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert T.PreTrainedModel.post_init is post_init  # nothing shared was patched
    ids = torch.randint(3, V, (2, 6))
    for key, models in loaded.items():
        want = small_a if key[0] == "a" else small_b
        for model in models:
            assert type(model) is T.LlamaForCausalLM
            assert heads.head_counts(model) == heads.head_counts(want)
            with torch.no_grad():
                torch.testing.assert_close(model(ids).logits, want(ids).logits, rtol=0, atol=0)


def test_pruned_bare_bert_loads_into_auto_and_task_classes(tmp_path):
    small = _pruned(T.AutoModel, _bert_config(), {"encoder.layer.0.attention.self": [0, 2]}, 0)
    small.save_pretrained(tmp_path)
    auto = mhtf.from_pretrained(T.AutoModel, tmp_path, attn_implementation=NAME)
    task = mhtf.from_pretrained(
        T.BertForSequenceClassification, tmp_path, attn_implementation=NAME, num_labels=3
    )
    assert type(auto) is T.BertModel and type(task) is T.BertForSequenceClassification
    assert heads.head_counts(task)["bert.encoder.layer.0.attention.self"] == 2
    assert task.config.multihead_heads == {"bert.encoder.layer.0.attention.self": [2, 2]}  # its own names
    ids = torch.randint(3, V, (2, 6))
    with torch.no_grad():
        want = small(ids).last_hidden_state
        torch.testing.assert_close(auto(ids).last_hidden_state, want, rtol=0, atol=0)
        torch.testing.assert_close(task.bert(ids).last_hidden_state, want, rtol=0, atol=0)
        assert task(ids).logits.shape == (2, 3)
    task.save_pretrained(tmp_path / "task")  # and back into the bare class
    bare = mhtf.from_pretrained(T.AutoModel, tmp_path / "task", attn_implementation=NAME)
    with torch.no_grad():
        torch.testing.assert_close(bare(ids).last_hidden_state, want, rtol=0, atol=0)


def test_loading_into_a_class_without_the_modules_is_a_clear_error(tmp_path):
    _pruned(T.AutoModel, _bert_config(), {"encoder.layer.0.attention.self": [0]}, 0).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no model for BertConfig"):
        mhtf.from_pretrained(T.AutoModelForImageClassification, tmp_path)


# ------------------------------------------------------------------------------------------------
# Private transformers internals: each adapter's test names the version when it changes
# ------------------------------------------------------------------------------------------------


def test_private_can_set_attn_implementation_still_judges_routing():
    ok = mhtf._routes_through_interface(T.LlamaForCausalLM) and not mhtf._routes_through_interface(
        _self_computing_class()
    )
    assert ok, f"{VERSION}: PreTrainedModel._can_set_attn_implementation changed meaning; update the adapter"


def test_private_output_collector_still_carries_output_attentions():
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(_llama_config(), attn_implementation=NAME).eval()
    seen = []
    hook = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda *_: seen.append(mhtf._recording_attentions())
    )
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # the adapter's fallback warning fails here
            out = model(torch.randint(3, V, (1, 4)), output_attentions=True)
            plain = model(torch.randint(3, V, (1, 4)))
    finally:
        hook.remove()
    assert seen == [True, False], (
        f"{VERSION}: transformers.utils.output_capturing._active_collector no longer says when attention "
        f"weights are recorded (saw {seen}); update multihead's _recording_attentions adapter"
    )
    assert len(out.attentions) == 2 and plain.attentions is None


def test_private_auto_model_mapping_still_resolves_classes():
    got = mhtf._model_class_for(T.AutoModelForCausalLM, _llama_config())
    assert got is T.LlamaForCausalLM, f"{VERSION}: Auto classes' _model_mapping changed; update the adapter"
    assert mhtf._model_class_for(T.BertModel, _bert_config()) is T.BertModel


def test_attention_modules_are_found_by_their_call_of_the_attention_functions():
    model = T.AutoModel.from_config(
        T.GPTNeoXConfig(
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=37,
            max_position_embeddings=32,
        ),
        attn_implementation=NAME,
    )
    assert heads.head_counts(model) == {"layers.0.attention": 4}, (
        f"{VERSION}: attention modules no longer name ALL_ATTENTION_FUNCTIONS in forward; update the adapter"
    )


def test_hugging_face_modules_get_no_attributes_from_multihead():
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(_llama_config(), attn_implementation=NAME).eval()
    before = {name: set(vars(m)) for name, m in model.named_modules()}
    ids = torch.randint(3, V, (1, 4))
    with torch.no_grad():
        with viz.capture(model) as cap:
            model(ids)
        with heads.masked(model, {"model.layers.0.self_attn": [1]}):
            model(ids)
    assert cap.names() == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert {name: set(vars(m)) for name, m in model.named_modules()} == before


def test_private_attention_modules_still_look_up_all_attention_functions():
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer
    from transformers.models.t5.modeling_t5 import T5Attention

    assert mhtf.internals._calls_attention_interface(T5Attention), (
        f"{VERSION}: attention modules no longer name ALL_ATTENTION_FUNCTIONS in forward; T5's attention "
        f"(recorded only through its wrapper) is invisible to the head tools -- update the adapter"
    )
    assert mhtf.internals._calls_attention_interface(LlamaAttention)
    assert not mhtf.internals._calls_attention_interface(LlamaDecoderLayer)
