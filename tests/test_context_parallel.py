"""context_parallel: multihead modules and a Hugging Face Llama, sequence-parallel, equal one process.

One forked job per world size runs every strategy (ring, ulysses, hybrid) on a stack of multihead
attention layers and on a tiny random Llama (padding, packed sequences), and returns the errors against
the single-process run; the tests assert on them (1e-4 relative for a whole model's outputs and grads).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import multihead as mh
from multihead import distributed as mhd

T = pytest.importorskip("transformers")

from multihead.integrations import transformers as mhtf  # noqa: E402

NAME = mhtf.register()
STRATEGIES = ("ring", "ulysses", "hybrid")


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([mh.MultiHeadAttention(24, 6, kv_heads=2) for _ in range(2)])

    def forward(self, x, **kw):
        for blk in self.blocks:
            x = x + blk(x, causal=True, **kw)
        return x


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _module_case(strategy, rank, world):
    torch.manual_seed(0)
    model = _Stack()
    x, gy = torch.randn(2, 16, 24), torch.randn(2, 16, 24)
    keep = torch.ones(2, 16, dtype=torch.bool)
    keep[1, 12:] = False
    ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 16])
    xr = x.clone().requires_grad_()
    (model(xr, mask=mh.masks.key_padding(keep), segment_ids=ids) * gy).sum().backward()
    want = _grads(model)
    model.zero_grad()
    before = [b.attention_fn for b in model.blocks]
    with mhd.context_parallel(model, strategy=strategy) as cp:
        part = cp.shard({"x": x, "gy": gy, "keep": keep, "ids": ids})
        xl = part["x"].requires_grad_()
        y = model(xl, mask=mh.masks.key_padding(part["keep"]), segment_ids=part["ids"])
        (y * part["gy"]).sum().backward()
    errs = {"x": _rel(xl.grad, mhd.shard(xr.grad, 1, rank, world, "zigzag"))}
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad)  # the training loop's job: parameter grads summed over the group
        errs[n] = _rel(p.grad, want[n])
    errs["restored"] = float(any(b.attention_fn is not f for b, f in zip(model.blocks, before)))
    return errs


def _llama():
    torch.manual_seed(0)
    config = T.LlamaConfig(
        vocab_size=50,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    return T.AutoModelForCausalLM.from_config(config, attn_implementation=NAME)


def _llama_case(strategy, kind, rank, world):
    model = _llama()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 50, (2, 16), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if kind == "padding":
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 11:] = 0
        batch["attention_mask"] = mask
        batch["labels"][1, 11:] = -100
    elif kind == "packed":  # padding-free: positions restart at each document, across rank boundaries
        batch["position_ids"] = torch.tensor(
            [list(range(7)) + list(range(9)), list(range(3)) + list(range(13))]
        )
    out = model(**batch)
    out.loss.backward()
    want, logits = _grads(model), out.logits.detach()
    model.zero_grad()
    with mhd.context_parallel(model, strategy=strategy) as cp:
        local = model(**cp.shard(batch))
        local.loss.backward()
    loss = local.loss.detach().clone()
    dist.all_reduce(loss)  # per-rank token-loss sums add up to the single-process loss
    errs = {
        "loss": _rel(loss, out.loss.detach()),
        "logits": _rel(local.logits.detach(), mhd.shard(logits, 1, rank, world, "zigzag")),
    }
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad)
        errs[n] = _rel(p.grad, want[n])
    errs["restored"] = float(any("attention_fn" in m.__dict__ for m in model.modules()))
    return errs


def _job():
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    res = {}
    for strategy in STRATEGIES:
        res[f"module-{strategy}"] = _module_case(strategy, rank, world)
        for kind in ("plain", "padding", "packed"):
            res[f"llama-{kind}-{strategy}"] = _llama_case(strategy, kind, rank, world)
    return res


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_equals_one_process(world):
    per_rank = mhd.launch(_job, world, timeout=240, start_method="fork")
    failures = []
    for rank, res in enumerate(per_rank):
        for case, errs in res.items():
            assert errs.pop("restored") == 0.0, f"{case}: the model was not restored on leaving the block"
            failures += [
                f"{case} rank {rank}: {n} off by {e:.2g} (relative)" for n, e in errs.items() if e > 1e-4
            ]
    assert not failures, "\n".join(failures)
