"""Physical head pruning, reloading pruned checkpoints, and iterative pruning within a budget.

Dimensions: H query heads, Hkv key/value heads, G = H // Hkv, Dk/Dv head dims, E embed_dim, O out_dim.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..core.checks import is_int
from ..nn.attention import MultiHeadAttention
from .importance import rank
from .naming import HeadSpec, _resolve, attention_modules, family_of, head_counts, module_heads

# ------------------------------------------------------------------------------------------------
# Pruning
# ------------------------------------------------------------------------------------------------


def head_rows(heads: Iterable[int], size: int) -> Tensor:
    """Row indices of ``heads`` in a projection where head i owns rows [i*size, (i+1)*size)."""
    idx = torch.as_tensor(list(heads), dtype=torch.long)
    return (idx[:, None] * size + torch.arange(size)).flatten()  # (n*size,)


def _reshape_heads(m: MultiHeadAttention, q_heads: list[int], kv_heads: list[int]) -> None:
    """Keep query heads ``q_heads`` and key/value heads ``kv_heads`` (repeats allowed), in that order.

    Query head j of the result uses key/value head ``j // (len(q_heads) // len(kv_heads))``.
    """
    dk, dv = m.head_dim, m.v_head_dim
    nq, nk, _ = m._proj_sizes()
    q_rows = head_rows(q_heads, dk)
    k_rows, v_rows = head_rows(kv_heads, dk), head_rows(kv_heads, dv)
    o_cols = head_rows(q_heads, dv)

    def take(p: nn.Parameter, rows: Tensor, dim: int = 0) -> nn.Parameter:
        new = nn.Parameter(p.detach().index_select(dim, rows.to(p.device)).clone())
        new.requires_grad_(p.requires_grad)
        return new

    fused_rows = torch.cat([q_rows, nq + k_rows, nq + nk + v_rows])  # rows of [q | k | v]
    if m.in_proj_weight is not None:
        m.in_proj_weight = take(m.in_proj_weight, fused_rows)
    else:
        m.q_proj_weight = take(m.q_proj_weight, q_rows)
        m.k_proj_weight = take(m.k_proj_weight, k_rows)
        m.v_proj_weight = take(m.v_proj_weight, v_rows)
    if m.in_proj_bias is not None:
        m.in_proj_bias = take(m.in_proj_bias, fused_rows)
    m.out_proj.weight = take(m.out_proj.weight, o_cols, dim=1)  # (O, H'*Dv)
    m.out_proj.in_features = len(q_heads) * dv
    m.num_heads, m.kv_heads = len(q_heads), len(kv_heads)


def plan(h: int, hkv: int, drop: Iterable[int], name: str) -> tuple[list[int], list[int]]:
    """Heads to keep when ``drop`` goes: ``(query heads, key/value heads)``, key/value heads repeated as needed.

    Query head j of the result uses key/value head ``j // (len(query heads) // len(key/value heads))``
    (the contiguous grouping every grouped-query layout uses). Raises ``ValueError`` when nothing is left.
    """
    dropped = set(drop)
    keep = [i for i in range(h) if i not in dropped]
    if not keep:
        raise ValueError(
            f"cannot prune all {h} heads of {name or 'the module'!r}: an attention layer needs at least one "
            f"head; keep one (its output is then the only attention contribution), or remove the whole "
            f"block from your model instead"
        )
    g = h // hkv
    groups = [[i for i in keep if i // g == j] for j in range(hkv)]  # kept query heads per KV head
    sizes = [len(c) for c in groups if c]
    size = math.gcd(*sizes)  # uneven groups: duplicate KV heads so every group has `size` query heads
    kv = [j for j, c in enumerate(groups) for _ in range(len(c) // size)]
    return keep, kv


def _prune_module(model: nn.Module, name: str, m: nn.Module, drop: list[int]) -> None:
    h, hkv = module_heads(m)
    keep, kv = plan(h, hkv, drop, name)
    if isinstance(m, MultiHeadAttention):
        _reshape_heads(m, keep, kv)
    else:
        family = family_of(m)
        assert family is not None  # attention_modules() found it
        family.reshape(model, name, m, keep, kv)


def prune(module_or_model: nn.Module, heads: HeadSpec, *, inplace: bool = False) -> nn.Module:
    """Remove heads for good: a smaller model equal to the gated model (:func:`masked`) with them zeroed.

    Args:
        module_or_model: a :class:`MultiHeadAttention` (then ``heads`` may be a list) or a model.
        heads: ``{module name: [head, ...]}`` (indices as the module is now) or a list for a bare module.
        inplace: modify ``module_or_model`` (default: prune and return a deep copy).

    Returns:
        The pruned module/model. Each pruned module loses head i's rows ``[i*Dk, (i+1)*Dk)`` of the Q
        projection (``in_proj_weight``/``q_proj_weight`` and ``in_proj_bias``) and columns
        ``[i*Dv, (i+1)*Dv)`` of ``out_proj.weight``; ``num_heads`` shrinks. ``out_proj.bias`` stays.

    Grouped-query attention (G = H // Hkv query heads per KV head): a KV head whose G query heads all go
    is removed too. If the groups left have unequal sizes (say 2 and 1), KV heads are duplicated so every
    group has gcd-of-sizes query heads (the module's contiguous grouping cannot express uneven groups);
    the result is still exact. Pruning every head of a module raises ``ValueError``.

    Save a pruned model with ``torch.save(model.state_dict(), path)`` and reload it with
    :func:`load_pruned` (a fresh model's shapes no longer match the checkpoint's). Hugging Face models
    (:mod:`multihead.integrations.transformers`) are pruned the same way, their real projections shrink,
    and ``save_pretrained`` / ``integrations.transformers.from_pretrained`` save and reload them.
    """
    model = module_or_model if inplace else copy.deepcopy(module_or_model)
    spec = _resolve(model, heads)
    modules = attention_modules(model)
    for name, drop in spec.items():  # check everything before changing anything
        plan(*module_heads(modules[name]), drop, name)  # raises the all-heads error
        family = family_of(modules[name])
        if drop and family is not None:
            family.check_prunable(name, modules[name])
    for name, drop in spec.items():
        if drop:
            _prune_module(model, name, modules[name], drop)
    return model


def load_pruned(
    model: nn.Module,
    state_dict: Mapping[str, Tensor],
    *,
    strict: bool = True,
    head_counts: Mapping[str, tuple[int, int]] | None = None,
) -> nn.Module:
    """Load a pruned checkpoint into a freshly built (unpruned) ``model`` of the same configuration.

    Each attention module is first resized to the checkpoint's head counts, then
    ``model.load_state_dict(state_dict, strict=strict)`` fills in the weights. Returns ``model``.

    Args:
        model: built with the same arguments as the model that was pruned and saved.
        state_dict: the pruned model's ``state_dict()``, e.g. ``torch.load(path, weights_only=True)``.
        strict: as in ``load_state_dict``; ``False`` also skips attention modules the checkpoint lacks.
        head_counts: ``{module name: (H, Hkv)}`` as saved (:func:`multihead.checkpoint.save` stores them in
            a ``.safetensors`` file's metadata). Modules not listed get theirs from the tensors' shapes:
            H from ``out_proj.weight`` (O, H*Dv), Hkv from the K/V projection rows.

    Load only files you trust with plain ``torch.load``; ``weights_only=True`` refuses pickled code::

        torch.save(pruned.state_dict(), "pruned.pt")
        state = torch.load("pruned.pt", weights_only=True)
        model = heads.load_pruned(Transformer(...same arguments...), state)

    :func:`multihead.checkpoint.load_model` does both steps, for ``.pt`` and ``.safetensors`` files.
    """
    counts = dict(head_counts or {})
    for name, m in attention_modules(model).items():
        if not isinstance(m, MultiHeadAttention):
            raise TypeError(
                f"load_pruned reloads multihead models; {name!r} is a {type(m).__name__}: reload a pruned "
                f"Hugging Face model with multihead.integrations.transformers.from_pretrained"
            )
        prefix = f"{name}." if name else ""
        key = f"{prefix}out_proj.weight"
        if key not in state_dict:
            if strict:
                raise ValueError(f"state_dict has no {key!r}: is it a checkpoint of this model's class?")
            continue
        h, hkv = counts[name] if name in counts else _counts_from_shapes(m, name, state_dict, prefix)
        if not (is_int(h, 1) and is_int(hkv, 1) and h % hkv == 0):
            raise ValueError(
                f"head_counts[{name!r}] must be (H, Hkv) with H a multiple of Hkv >= 1, got {(h, hkv)!r}"
            )
        if (h, hkv) != (m.num_heads, m.kv_heads):
            # any rows will do: load_state_dict overwrites them; index 0 exists in every projection
            _reshape_heads(m, [0] * h, [0] * hkv)
    model.load_state_dict(state_dict, strict=strict)
    return model


def _counts_from_shapes(
    m: MultiHeadAttention, name: str, state_dict: Mapping[str, Tensor], prefix: str
) -> tuple[int, int]:
    """(H, Hkv) implied by a checkpoint's projection shapes for module ``m`` (its Dk, Dv)."""
    key = f"{prefix}out_proj.weight"
    dk, dv = m.head_dim, m.v_head_dim
    cols = state_dict[key].shape[1]  # H*Dv
    h = cols // dv
    if m.in_proj_weight is not None:
        kv_rows, kv_size = state_dict[f"{prefix}in_proj_weight"].shape[0] - h * dk, dk + dv  # Hkv*(Dk+Dv)
    else:
        kv_rows, kv_size = state_dict[f"{prefix}k_proj_weight"].shape[0], dk  # Hkv*Dk
    hkv = kv_rows // kv_size
    if cols % dv or kv_rows % kv_size or hkv <= 0 or h % hkv:
        raise ValueError(
            f"checkpoint tensors of {name or 'the module'!r} do not fit head dims Dk={dk}, Dv={dv}: "
            f"{key} has shape {tuple(state_dict[key].shape)}; build the model with the same "
            f"head_dim/v_head_dim as the checkpoint's"
        )
    return h, hkv


# ------------------------------------------------------------------------------------------------
# Iterative pruning
# ------------------------------------------------------------------------------------------------


@dataclass
class PruneStep:
    """One tried step: how many heads it would remove, the metric after it, and whether it was kept."""

    removed: int
    heads_left: int
    metric: float
    accepted: bool


@dataclass
class PruneResult:
    """What :func:`prune_iteratively` returns."""

    model: nn.Module
    pruned: dict[str, list[int]]  # module name -> removed heads, as indices of the ORIGINAL module
    baseline: float
    metric: float
    history: list[PruneStep] = field(default_factory=list)

    @property
    def num_pruned(self) -> int:
        """Heads removed in all."""
        return sum(len(v) for v in self.pruned.values())


def prune_iteratively(
    model: nn.Module,
    score: Callable[[nn.Module], Mapping[str, Tensor]],
    metric: Callable[[nn.Module], float],
    *,
    step: float = 0.1,
    budget: float = 1.0,
    min_heads: int = 1,
    patience: int | None = None,
    progress: Callable[[PruneStep], None] | None = None,
) -> PruneResult:
    """Prune the least important heads step by step while ``metric`` stays within ``budget`` of the start.

    Args:
        model: the trained model (left unchanged; the result holds a pruned copy).
        score: ``score(model)`` -> ``{name: (H,) scores}``, e.g.
            ``lambda m: importance(m, batches, loss_fn)``; recomputed after every accepted step.
        metric: ``metric(model)`` -> float, higher is better (e.g. held-out accuracy in %).
        step: the schedule: each step removes this fraction of the original number of heads (at least 1).
            When a step would leave the budget, it is retried with half as many heads, down to one; a
            single head that still leaves the budget is kept for good and the next-ranked head is tried
            (scores are not the metric: the least important head by gradient can still be the one the
            metric needs).
        budget: how much ``metric`` may fall below the unpruned model's (same units, e.g. points).
        min_heads: heads every module keeps (>= 1: an attention layer cannot lose all its heads).
        patience: stop after this many single-head rejections in a row (default: try every head).
        progress: called with each :class:`PruneStep` tried.

    Returns:
        :class:`PruneResult`: the most pruned model found within the budget, the removed heads in the
        original indexing, and the history of tried steps.
    """
    if not 0.0 < step <= 1.0:
        raise ValueError(f"step must be a fraction of the heads in (0, 1], got {step!r}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0 (how much the metric may drop), got {budget!r}")
    if not is_int(min_heads, 1):
        raise ValueError(
            f"min_heads must be an int >= 1 (a module cannot lose every head), got {min_heads!r}"
        )
    if patience is not None and not is_int(patience, 1):
        raise ValueError(
            f"patience must be None or an int >= 1 (single-head rejections in a row), got {patience!r}"
        )
    current = copy.deepcopy(model)
    original = {name: list(range(h)) for name, h in head_counts(current).items()}  # current -> original
    total = sum(len(v) for v in original.values())
    n = max(1, round(step * total))
    baseline = float(metric(current))
    best = baseline
    history: list[PruneStep] = []
    scores: Mapping[str, Tensor] | None = None
    kept: set[tuple[str, int]] = set()  # (name, original index) of heads a single-head step could not remove
    misses = 0  # single-head rejections in a row
    while n >= 1 and (patience is None or misses < patience):
        if scores is None:
            scores = score(current)
        left = {name: len(v) for name, v in original.items()}
        chosen: dict[str, list[int]] = {}
        for name, h in rank(scores):
            if sum(len(v) for v in chosen.values()) == n:
                break
            if left[name] > min_heads and (name, original[name][h]) not in kept:
                chosen.setdefault(name, []).append(h)
                left[name] -= 1
        if not chosen:
            break
        candidate = prune(current, chosen)
        value = float(metric(candidate))
        ok = value >= baseline - budget
        removed = sum(len(v) for v in chosen.values())
        tried = PruneStep(removed, sum(left.values()), value, ok)
        history.append(tried)
        if progress is not None:
            progress(tried)
        if ok:
            current, best, scores, misses = candidate, value, None, 0
            for name, drop in chosen.items():
                original[name] = [o for i, o in enumerate(original[name]) if i not in set(drop)]
        elif n > 1:
            n //= 2
        else:
            ((name, (h,)),) = chosen.items()
            kept.add((name, original[name][h]))
            misses += 1
    pruned = {
        name: [h for h in range(count) if h not in set(original[name])]
        for name, count in head_counts(model).items()
    }
    return PruneResult(current, {k: v for k, v in pruned.items() if v}, baseline, best, history)
