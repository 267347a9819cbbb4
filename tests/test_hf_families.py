"""Modern causal-LM families on multihead equal eager: soft-capping (Gemma 2), attention sinks (gpt-oss,
Granite SWA, Flint, DeepSeek-V4), and the survey of every causal-LM family transformers has.

Tiny random configs only (no hub access). ``python tests/test_hf_families.py`` runs the survey: every
family of ``MODEL_FOR_CAUSAL_LM_MAPPING`` built tiny, compared with eager on the same weights, counted
by outcome (docs/transformers.md quotes the counts).
"""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch

T = pytest.importorskip("transformers")

from multihead.integrations import transformers as mhtf  # noqa: E402

NAME = mhtf.register()
V = 64

SIZES = dict(
    vocab_size=V,
    hidden_size=32,
    n_embd=32,
    d_model=32,
    num_hidden_layers=2,
    n_layer=2,
    num_layers=2,
    num_attention_heads=4,
    n_head=4,
    num_heads=4,
    num_key_value_heads=2,
    intermediate_size=37,
    ffn_hidden_size=37,
    head_dim=8,
    max_position_embeddings=64,
    n_positions=64,
    sliding_window=3,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=37,
    decoder_ffn_dim=37,
    ffn_dim=37,
    d_ff=37,
    n_inner=37,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    shared_expert_intermediate_size=16,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
"""Tiny sizes, applied to a config class only where it has the attribute (a shared vocabulary of names)."""


def tiny_config(config_class: type, **overrides):
    """A tiny instance of ``config_class``: :data:`SIZES` where the class knows the name, then ``overrides``."""
    known = config_class().to_dict()
    return config_class(**{k: v for k, v in {**SIZES, **overrides}.items() if k in known or k in overrides})


def compare(model_class, config, *, generate: bool = False, seed: int = 0) -> float:
    """Largest |multihead - eager| logit difference on real tokens of a left-padded batch (same weights).

    With ``generate``, also asserts that greedy decoding gives the same tokens.
    """
    torch.manual_seed(seed)
    config._experts_implementation = "eager"  # mixture-of-experts layers: plain loops at tiny sizes
    eager = model_class.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    ours = model_class.from_config(copy.deepcopy(config), attn_implementation=NAME).eval()
    ours.load_state_dict(eager.state_dict())
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(3, V, (2, 7), generator=g)
    keep = torch.ones(2, 7, dtype=torch.long)
    keep[0, :2] = 0  # left padding on the first row
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=keep).logits
        got = ours(input_ids=ids, attention_mask=keep).logits
    real = keep.bool()
    err = float((got[real] - want[real]).abs().max())
    if generate:
        kw = dict(attention_mask=keep, max_new_tokens=5, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            assert ours.generate(ids, **kw).tolist() == eager.generate(ids, **kw).tolist()
    return err


MODERN = {
    "gemma2 (softcap)": (T.Gemma2Config, dict(attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gpt_oss (sinks)": (T.GptOssConfig, {}),
    "granite_swa (sinks)": (T.GraniteSwaConfig, {}) if hasattr(T, "GraniteSwaConfig") else None,
    "flint (sinks)": (T.FlintConfig, {}) if hasattr(T, "FlintConfig") else None,
    "gemma3_text (alternating windows)": (T.Gemma3TextConfig, dict(sliding_window_pattern=2)),
    "cohere2 (alternating windows)": (T.Cohere2Config, {}),
}
MODERN = {k: v for k, v in MODERN.items() if v is not None}


@pytest.mark.parametrize("family", list(MODERN))
def test_modern_family_equals_eager_and_generates_the_same(family):
    config_class, overrides = MODERN[family]
    config = tiny_config(config_class, **overrides)
    err = compare(T.AutoModelForCausalLM, config, generate=True)
    assert err <= 1e-5, f"{family}: max |multihead - eager| = {err:.2e}"


# ------------------------------------------------------------------------------------------------
# The survey (not a test): python tests/test_hf_families.py
# ------------------------------------------------------------------------------------------------


def _record(outcomes: dict[str, list[tuple[str, str]]], kind: str, family: str, note: str) -> None:
    outcomes.setdefault(kind, []).append((family, note))
    print(f"{family}: {kind}: {note}", file=sys.stderr, flush=True)


def survey(families: list[str] | None = None) -> dict[str, list[tuple[str, str]]]:
    """Causal-LM families of transformers (default: all), tiny, on multihead vs eager.

    Returns ``{outcome: [(family, note)]}``; each family's outcome is also printed to stderr as it comes.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    outcomes: dict[str, list[tuple[str, str]]] = {}
    for model_type in families or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config_class = T.CONFIG_MAPPING[model_type]
            config = tiny_config(config_class)
            with torch.device("meta"):  # count first: a config whose sizes have other names stays big
                big = T.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
            size = sum(p.numel() for p in big.parameters())
            if size > 3_000_000:
                raise MemoryError(f"{size:,} parameters")
        except Exception as exc:  # noqa: BLE001 - the survey records it
            _record(outcomes, "no tiny eager model", model_type, f"{type(exc).__name__}: {exc}"[:80])
            continue
        try:
            err = compare(T.AutoModelForCausalLM, config)
        except ValueError as exc:
            kind = "refused by multihead" if "cannot run on multihead" in str(exc) else "error"
            _record(outcomes, kind, model_type, str(exc)[:100])
            continue
        except KeyError as exc:
            _record(outcomes, "refused by transformers (no such implementation)", model_type, str(exc)[:60])
            continue
        except Exception as exc:  # noqa: BLE001
            _record(outcomes, "error", model_type, f"{type(exc).__name__}: {str(exc)[:100]}")
            continue
        kind = "equal to eager (1e-5)" if err <= 1e-5 else "differs"
        _record(outcomes, kind, model_type, f"{err:.1e}")
    return outcomes


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    T.logging.set_verbosity_error()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    everything = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    start, stop = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (0, len(everything))
    result = survey(everything[start:stop])
    for kind, rows in result.items():
        print(f"{kind}: {len(rows)}")
        for family, note in rows:
            print(f"    {family}: {note}")
    sys.exit(0)
