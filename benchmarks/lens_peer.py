"""TransformerLens 4.3's side of ``benchmarks/bench_lens.py``: its bridge over the same checkpoint, its hooks
read in multihead's layout, its edits, its patching loop; and the inputs both tools run on.

TransformerLens (``transformer_lens.model_bridge.TransformerBridge.boot_transformers(folder)``) wraps the
Hugging Face model and, for a Llama, runs its own re-implementation of the attention
(``PositionEmbeddingsAttentionBridge.forward``: eager matmuls, ``attn_implementation`` forced to "eager").
No ``enable_compatibility_mode()`` is needed for the hook names below (it would fold the norms into the
weights, which changes every activation). Its hooks and multihead's points (B batch, L tokens, H = 9
query heads, Hkv = 3 key/value heads, D = 64 head dim, E = 576 model width):

==========  ==================================  ===============================================
multihead   TransformerLens 4.3 (blocks.{l}.)   what its hook holds
==========  ==================================  ===============================================
q           attn.hook_rot_q                     (B, L, H, D) after rotary; ``attn.hook_q`` is
                                                before rotary (the projection's output)
k           attn.hook_rot_k                     (B, L, Hkv, D) after rotary, not repeated to H
v           attn.hook_v                         (B, L, Hkv, D), not repeated to H
scores      attn.hook_attn_scores               (B, H, L, L), scaled by D**-0.5; masked entries
                                                hold float32's min (-3.4e38; -inf only in
                                                compatibility mode), multihead's hold -inf
pattern     attn.hook_pattern                   (B, H, L, L)
z           attn.hook_z (= attn.o.hook_in)      (B, L, H, D)
result      attn.hook_result                    (B, L, H, E); fires only after
                                                ``bridge.set_use_attn_result(True)``
==========  ==================================  ===============================================

Its tensors are moved to multihead's layout here (heads before positions) and nowhere else.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

HOOKS = {
    "q": "attn.hook_rot_q",
    "k": "attn.hook_rot_k",
    "v": "attn.hook_v",
    "scores": "attn.hook_attn_scores",
    "pattern": "attn.hook_pattern",
    "z": "attn.hook_z",
    "result": "attn.hook_result",
}
"""multihead's point -> TransformerLens's hook inside ``blocks.{layer}.``."""
PER_POSITION = {"q", "k", "v", "z", "result"}  # TL holds these (B, L, heads, ...): positions first

# IOI-style prompt pair (14 tokens each): the clean run names Mary as the answer, the corrupted run John
CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"
ANSWERS = (" Mary", " John")  # (right answer of the clean prompt, right answer of the corrupted one)


def hook_name(layer: int, point: str) -> str:
    """TransformerLens's hook name of multihead's ``point`` in ``layer``: ``blocks.3.attn.hook_z``."""
    return f"blocks.{layer}.{HOOKS[point]}"


def to_multihead(point: str, x: torch.Tensor) -> torch.Tensor:
    """A TransformerLens hook tensor in multihead's layout: (B, L, heads, ...) -> (B, heads, L, ...)."""
    return x.transpose(1, 2) if point in PER_POSITION else x


def boot(folder: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """TransformerLens's bridge over the checkpoint ``folder`` (local files only), on the CPU, in eval mode."""
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(folder, device="cpu", dtype=dtype)
    bridge.eval()
    return bridge


def real_text(tokenizer: object, length: int) -> torch.Tensor:
    """Token ids (1, ``length``) of real English the project did not write: the docstring of Python's
    ``argparse`` module (575 SmolLM2 tokens), cut to its first ``length`` tokens."""
    import argparse

    ids = tokenizer(inspect.getdoc(argparse), return_tensors="pt").input_ids  # (1, 575)
    if ids.shape[1] < length:
        raise ValueError(f"length: argparse's docstring has {ids.shape[1]} tokens, asked for {length}")
    return ids[:, :length]


class PromptPair(NamedTuple):
    """The patching experiment: clean and corrupted token ids (1, L) and the two answers' token ids."""

    clean: torch.Tensor
    corrupted: torch.Tensor
    right: int
    wrong: int

    def logit_diff(self, logits: torch.Tensor) -> torch.Tensor:
        """Per example (B,): the clean answer's logit minus the corrupted answer's at the last position."""
        return logits[:, -1, self.right] - logits[:, -1, self.wrong]


def prompt_pair(tokenizer: object) -> PromptPair:
    """:data:`CLEAN` and :data:`CORRUPTED` tokenized (equal lengths, checked) with :data:`ANSWERS`."""
    clean, corrupted = (tokenizer(t, return_tensors="pt").input_ids for t in (CLEAN, CORRUPTED))
    if clean.shape != corrupted.shape:
        raise ValueError(f"the prompts differ in length: {clean.shape} vs {corrupted.shape}")
    right, wrong = (tokenizer(a).input_ids for a in ANSWERS)
    if len(right) != 1 or len(wrong) != 1:
        raise ValueError(f"each answer must be one token, got {right} and {wrong}")
    return PromptPair(clean, corrupted, right[0], wrong[0])


def points(bridge: torch.nn.Module, ids: torch.Tensor, names: Sequence[str]) -> dict:
    """{(layer, point): tensor in multihead's layout} of every layer, and the logits under ``"logits"``."""
    wanted = {hook_name(layer, p): (layer, p) for layer in range(bridge.cfg.n_layers) for p in names}
    if "result" in names:
        bridge.set_use_attn_result(True)
    try:
        with torch.no_grad():
            logits, cache = bridge.run_with_cache(ids, names_filter=lambda n: n in wanted)
    finally:
        bridge.set_use_attn_result(False)
    out: dict = {key: to_multihead(key[1], cache[name]) for name, key in wanted.items()}
    out["logits"] = logits
    return out


def cached_run(bridge: torch.nn.Module, ids: torch.Tensor, names: Sequence[str]) -> Callable[[], object]:
    """One timed call: ``run_with_cache`` keeping ``names``' hooks of every layer (its names filter)."""
    wanted = frozenset(hook_name(layer, p) for layer in range(bridge.cfg.n_layers) for p in names)

    def run() -> object:
        with torch.no_grad():
            return bridge.run_with_cache(ids, names_filter=lambda n: n in wanted)

    return run


def zero_head(bridge: torch.nn.Module, ids: torch.Tensor, layer: int, head: int, point: str) -> torch.Tensor:
    """The logits with head ``head`` of ``layer`` zeroed at ``point``'s hook ("z": TransformerLens's zero
    ablation; "q": that head's rotated queries, so its pattern becomes uniform over the visible keys)."""

    def zero(x: torch.Tensor, hook: object) -> torch.Tensor:  # x: (B, L, heads, D)
        x[:, :, head] = 0.0
        return x

    with torch.no_grad():
        return bridge.run_with_hooks(ids, fwd_hooks=[(hook_name(layer, point), zero)])


def clean_z(bridge: torch.nn.Module, pair: PromptPair) -> object:
    """The clean run's cache of ``hook_z`` in every layer (what TransformerLens's patching reads)."""
    names = frozenset(hook_name(layer, "z") for layer in range(bridge.cfg.n_layers))
    with torch.no_grad():
        return bridge.run_with_cache(pair.clean, names_filter=lambda n: n in names)[1]


def patch_loop(
    bridge: torch.nn.Module, pair: PromptPair, clean: object, heads: Sequence[tuple[int, int]]
) -> torch.Tensor:
    """TransformerLens's own patching loop over ``heads`` [(layer, head)]
    (``patching.get_act_patch_attn_head_out_all_pos``: one forward of the corrupted prompt per head, that
    head's ``hook_z`` taken from the clean cache :func:`clean_z`): the logit difference per head, (len(heads),)."""
    import pandas as pd
    from transformer_lens import patching

    patching.tqdm = lambda rows: rows  # its progress bar off: the loop's own work is what is timed
    index = pd.DataFrame(list(heads), columns=["layer", "head"])
    with torch.no_grad():
        return patching.get_act_patch_attn_head_out_all_pos(
            bridge,
            pair.corrupted,
            clean,
            pair.logit_diff,
            index_df=index,
            index_axis_names=None,
            reduce="mean",
        )
