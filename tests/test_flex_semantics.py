"""FlexAttention's mask_mods run unchanged: every mask_mod of attention-gym's ``attn_gym.masks`` gives, through
``mh.attention``, what torch's own eager ``flex_attention`` gives on the same inputs (awkward lengths,
Lq != Lk included), on the dense and the tiled backends; and a failing function gets a clear ValueError."""

from __future__ import annotations

import inspect

import pytest
import torch

import multihead as mh
from multihead.core.attention import prepare
from multihead.core.backends.blocked import BlockedBackend

flex = pytest.importorskip("torch.nn.attention.flex_attention")
gym = pytest.importorskip(
    "attn_gym.masks", reason="attn-gym (requirements-dev.txt) is not installed: no attention-gym mask_mods"
)

B, H, D = 2, 2, 16


def _doc_offsets(length: int, device: str = "cpu") -> torch.Tensor:
    """Cumulative offsets of 4 documents of uneven lengths filling ``length`` tokens: (5,)."""
    cuts = sorted({0, length // 5, length // 2, length // 2 + 3, length})
    return torch.tensor(cuts, device=device)


def _tree(nodes: int) -> torch.Tensor:
    """A JetSpec ancestor matrix of a tree of ``nodes`` nodes (each node's parent is (i - 1) // 2)."""
    return gym.build_tree_ancestor_matrix([-1] + [(i - 1) // 2 for i in range(1, nodes)], device="cpu")


# name -> (lq, lk, mask_mod): each at an awkward length; Lq != Lk where the mask is made for it
CASES = {
    "causal_mask": lambda: (97, 97, gym.causal_mask),
    "causal_mask (Lq < Lk, top-left)": lambda: (61, 150, gym.causal_mask),
    "batchify_mask_mod": lambda: (130, 130, gym.batchify_mask_mod(gym.causal_mask, 37)),
    "generate_block_diffusion_mask": lambda: (2 * 70, 2 * 70, gym.generate_block_diffusion_mask(70, 16)),
    "generate_dilated_sliding_window": lambda: (129, 129, gym.generate_dilated_sliding_window(24, 3)),
    "generate_doc_mask_mod": lambda: (
        150,
        150,
        gym.generate_doc_mask_mod(gym.causal_mask, _doc_offsets(150)),
    ),
    "generate_packed_causal_doc_mask_mod": lambda: (
        150,
        150,
        gym.generate_packed_causal_doc_mask_mod(_doc_offsets(150)),
    ),
    "generate_vision_cross_attention_mask_mod": lambda: (
        77,
        3 * 20,  # 3 images of 20 tokens: the keys; the text tokens are the queries
        gym.generate_vision_cross_attention_mask_mod(torch.tensor([[0, 30], [10, 50], [40, 77]]), 20),
    ),
    "generate_global_sliding_window": lambda: (
        111,
        111,
        gym.generate_global_sliding_window(9, torch.arange(111) % 29 == 3),
    ),
    "generate_jetspec_tree_causal_mask_mod": lambda: (
        31,
        19 + 31,
        gym.generate_jetspec_tree_causal_mask_mod(19, _tree(31)),
    ),
    "generate_jetspec_training_mask_mod": lambda: (
        3 * 13,
        23 + 3 * 13,
        gym.generate_jetspec_training_mask_mod(23, 13),
    ),
    "generate_natten": lambda: (99, 99, gym.generate_natten(11, 9, 3, 5)),
    "generate_tiled_natten": lambda: (96, 96, gym.generate_tiled_natten(12, 8, 3, 5, 4, 4)),
    "generate_morton_natten": lambda: (64, 64, gym.generate_morton_natten(8, 8, 3, 3)),
    "generate_prefix_lm_mask": lambda: (101, 101, gym.generate_prefix_lm_mask(17)),
    "generate_shared_prefix_mask_mod": lambda: (
        150,
        150,
        gym.generate_shared_prefix_mask_mod(_doc_offsets(150), torch.tensor([0, 0, 0, 3])),
    ),
    "generate_sliding_window": lambda: (97, 97, gym.generate_sliding_window(13)),
    "generate_sliding_window (Lq > Lk)": lambda: (150, 61, gym.generate_sliding_window(13)),
    "generate_spatial_head_mask_mod": lambda: (
        7 + 5 * 19,
        7 + 5 * 19,
        gym.generate_spatial_head_mask_mod(prompt_length=7, num_frames=5, token_per_frame=19, round_width=8),
    ),
    "generate_temporal_head_mask_mod": lambda: (
        7 + 5 * 19,
        7 + 5 * 19,
        gym.generate_temporal_head_mask_mod(prompt_length=7, num_frames=5, token_per_frame=19, width=1),
    ),
    "generate_sta_mask_mod_2d": lambda: (
        8 * 8 + 9,
        8 * 8 + 9,
        gym.generate_sta_mask_mod_2d((8, 8), (2, 2), (2, 2), text_seq_len=9),
    ),
    "generate_sta_mask_mod_3d": lambda: (
        4 * 4 * 4 + 5,
        4 * 4 * 4 + 5,
        gym.generate_sta_mask_mod_3d((4, 4, 4), (2, 2, 2), (2, 2, 2), text_seq_len=5),
    ),
    "generate_vsa_mask_mod": lambda: (
        100,
        100,
        gym.generate_vsa_mask_mod(
            torch.tensor([[[[t, (t + 3) % 7] for t in range(7)]] * H] * B), 16, torch.tensor([16] * 6 + [4])
        ),
    ),
}


def _mask_mod_makers() -> set[str]:
    """Every public function of attn_gym.masks that returns a mask_mod, and the mask_mods it defines."""
    names = set()
    for name, obj in vars(gym).items():
        if name.startswith("_") or not inspect.isfunction(obj):
            continue
        ret = str(inspect.signature(obj).return_annotation)
        params = list(inspect.signature(obj).parameters)
        if "Callable" in ret or "mask_mod" in ret or params == ["b", "h", "q_idx", "kv_idx"]:
            names.add(name)
    return names


def test_every_attention_gym_mask_mod_is_covered():
    """A mask_mod added to attention-gym fails here until it joins CASES."""
    covered = {name.split(" ")[0] for name in CASES}
    assert _mask_mod_makers() <= covered, sorted(_mask_mod_makers() - covered)


def _flex_reference(q, k, v, mask_mod):
    """torch's own eager flex_attention with the mask_mod's block mask: (B, H, Lq, D)."""
    lq, lk = q.shape[2], k.shape[2]
    block_mask = flex.create_block_mask(mask_mod, B, H, lq, lk, device="cpu")
    return flex.flex_attention(q, k, v, block_mask=block_mask)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", sorted(CASES))
def test_attention_gym_mask_mods_equal_flex_attention(name):
    lq, lk, mask_mod = CASES[name]()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=gen) for n in (lq, lk, lk))
    want = _flex_reference(q, k, v, mask_mod)
    for backend in ("math", "blocked"):
        got = mh.attention(q, k, v, mask=mask_mod, backend=backend)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5, msg=f"{name} on {backend}")
    tiled = BlockedBackend(block_q=16, span_k=24)(prepare(q, k, v, mask=mask_mod))[0]  # many small tiles
    torch.testing.assert_close(tiled, want, atol=2e-6, rtol=2e-5, msg=f"{name} on small tiles")


def test_a_function_that_broadcast_indices_would_misread_gets_the_scalar_meaning():
    """Flamingo's mask reads ``intervals[image][0]``: on broadcast index tensors ``[0]`` would take the first
    image, on FlexAttention's scalars the interval's start. The scalar meaning is the one used."""
    intervals = torch.tensor([[0, 3], [2, 6]])
    mod = gym.generate_vision_cross_attention_mask_mod(intervals, 2)  # keys: 2 images x 2 tokens
    got = mh.masks.evaluate_fn(mod, (1, 1, 6, 4), "mask")[0, 0].int().tolist()
    assert got == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1]]


def test_a_function_that_raises_gets_a_value_error_naming_it_with_the_users_exception_chained():
    table = torch.zeros(10, dtype=torch.bool)

    def lookup(b, h, q_idx, kv_idx):
        return table[kv_idx]  # only 10 keys in the table

    q = k = v = torch.randn(1, 1, 12, 8)
    with pytest.raises(ValueError, match="'lookup'") as info:
        mh.attention(q, k, v, mask=lookup)
    assert isinstance(info.value.__cause__, (IndexError, RuntimeError))


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda b, h, q, kv: q - kv, "must return a bool tensor.*got dtype torch.int64"),
        (lambda b, h, q, kv: torch.ones(3, dtype=torch.bool), r"returned shape \(1, 1, 4, 4, 3\)"),
        (lambda b, h, q, kv: None, "got NoneType"),
    ],
)
def test_a_function_that_returns_the_wrong_thing_gets_a_value_error_saying_what(fn, match):
    q = k = v = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match=match):
        mh.attention(q, k, v, mask=fn)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_score_mod_passed_as_bias_or_mask_is_refused_with_the_way_to_pass_it():
    """attention-gym's score_mods take (score, b, h, q_idx, kv_idx); a bias or mask takes (b, h, q_idx, kv_idx)."""
    mods = pytest.importorskip("attn_gym.mods")
    alibi = mods.generate_alibi_bias(H)
    q = k = v = torch.randn(1, H, 6, 8)
    for kind in ("bias", "mask"):
        with pytest.raises(ValueError, match=f"{kind} function 'alibi_mod'.*score_mod.*score_mod\\(0"):
            mh.attention(q, k, v, **{kind: alibi})
    with pytest.raises(ValueError, match="softcap="):
        mh.attention(q, k, v, bias=mods.generate_tanh_softcap(5.0))
    # the way the error gives: an additive score_mod at score 0 is its bias, equal to flex_attention's result
    got = mh.attention(q, k, v, bias=lambda b, h, q_idx, kv_idx: alibi(0.0, b, h, q_idx, kv_idx))
    torch.testing.assert_close(got, flex.flex_attention(q, k, v, score_mod=alibi), atol=2e-6, rtol=2e-5)
