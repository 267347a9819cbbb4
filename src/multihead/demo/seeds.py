"""Every seed notebook's example configuration, run through the library with a parity check.

Each row builds :class:`multihead.MultiHeadAttention` at a seed's sizes, runs its example input, and
compares against ``torch.nn.MultiheadAttention`` holding the same weights (where torch can express it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..nn.attention import MultiHeadAttention


@dataclass
class SeedCase:
    name: str
    batch: int
    lq: int
    lk: int
    d_model: int
    heads: int
    valid_lens: list[int] | None = None
    bias: bool = True


SEED_CASES = [
    SeedCase("000 Keras MHA (B=64, L=5, d_model=512, h=8)", 64, 5, 5, 512, 8),
    SeedCase("001 PyTorch from scratch (B=2, L=5, d_model=512, h=8)", 2, 5, 5, 512, 8),
    SeedCase("002 TF fused QKV (B=30, L=4, d_model=512, h=8)", 30, 4, 4, 512, 8),
    SeedCase("003 d2l DJL (B=2, 4 queries, 6 kv, 100 hiddens, 5 heads)", 2, 4, 6, 100, 5, [3, 2], False),
    SeedCase("004 d2l TF (B=2, 4 queries, 6 kv, 100 hiddens, 5 heads)", 2, 4, 6, 100, 5, [3, 2], False),
]


def run_case(case: SeedCase, generator: torch.Generator) -> tuple[tuple[int, ...], float]:
    """Run one seed configuration; return the output shape and the max |ours - torch| difference."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
    mha = MultiHeadAttention(case.d_model, case.heads, bias=case.bias).eval()
    x = torch.rand(case.batch, case.lq, case.d_model, generator=generator)
    y = x if case.lq == case.lk else torch.rand(case.batch, case.lk, case.d_model, generator=generator)
    ref = mha.to_torch().eval()
    pad = None
    valid = None
    if case.valid_lens is not None:
        valid = torch.tensor(case.valid_lens)
        pad = torch.arange(case.lk)[None, :] >= valid[:, None]  # torch: True = padding
    with torch.no_grad():
        ours = mha(x, y, y, valid_lens=valid)
        theirs = ref(x, y, y, key_padding_mask=pad, need_weights=False)[0]
    return tuple(ours.shape), float((ours - theirs).abs().max())


def run(seed: int = 0) -> int:
    """Print each seed case's output shape and its parity with torch.nn.MultiheadAttention."""
    generator = torch.Generator().manual_seed(seed)
    worst = 0.0
    print(f"{'seed example':<62} {'output shape':<16} max |ours - torch|")
    for case in SEED_CASES:
        shape, diff = run_case(case, generator)
        worst = max(worst, diff)
        print(f"{case.name:<62} {str(shape):<16} {diff:.2e}")
    ok = worst < 1e-5
    print("parity with torch.nn.MultiheadAttention:", "OK" if ok else "FAILED", f"(worst {worst:.2e})")
    return 0 if ok else 1
