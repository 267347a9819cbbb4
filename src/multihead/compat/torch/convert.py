"""``convert`` / ``revert``: every ``torch.nn.MultiheadAttention`` of a model swapped for the drop-in, and back.

One call for a model you already have, as ``nn.SyncBatchNorm.convert_sync_batchnorm`` is for batch norm::

    model = convert(torchvision.models.VisionTransformer(...))   # 12 attention modules now run on multihead
    with multihead.viz.capture(model) as cap:                     # and the head tools see them
        model(images)

What changes: each ``nn.MultiheadAttention`` becomes :class:`~multihead.compat.torch.MultiheadAttention`,
which takes the old module's own ``Parameter`` objects (the exact tensors: values, ``requires_grad``,
device and dtype; an optimizer built before ``inplace=True`` still steps them), its flags and its
train/eval mode. Nothing else changes: ``state_dict`` keys and shapes stay, so checkpoints load both
ways with ``strict=True``. torch's ``nn.TransformerEncoderLayer``/``DecoderLayer``, ``nn.TransformerEncoder``/
``Decoder`` and ``nn.Transformer`` keep their own code (norms, feed-forward, residuals, the nested-tensor
path) with the drop-in as their attention; their fused inference kernel, which would bypass it, is never
taken around a drop-in (:mod:`.attention`). So the converted model computes what the original computes,
in train and eval, with and without grad, and every attention in it goes through multihead.

Subclasses of torch's classes (``class MyLayer(nn.TransformerEncoderLayer)``) may run code of their own
that reads the attention's weights past its ``forward``: they are left alone, with everything inside
them, and reported (a ``logging`` warning) unless ``subclasses=True``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from .attention import MultiheadAttention, _always_call_me, _flags

__all__ = ["TORCH_CLASSES", "convert", "revert"]

logger = logging.getLogger(__name__)

# torch's classes that hold nn.MultiheadAttention modules; a subclass of one may bypass the drop-in
TORCH_CLASSES: tuple[type[nn.Module], ...] = (
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.Transformer,
)


@dataclass
class _Walk:
    """One pass over a module tree: ``swap(m)`` gives a module's replacement (or None to look inside it),
    ``left_alone(m)`` says whether to skip ``m`` and everything inside it. It records what it did.

    :meth:`visit` changes nothing in the tree: it builds the replacements (which take the old modules'
    parameters) and lists where they go; :meth:`apply` puts them there. So a replacement that fails
    (ValueError) leaves the model as it was, also with ``inplace=True``."""

    swap: Callable[[nn.Module], nn.Module | None]
    left_alone: Callable[[nn.Module], bool]
    swapped: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    done: dict[int, nn.Module] = field(default_factory=dict)  # id(old) -> new: a shared module stays shared
    pending: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)  # (parent, child name, new)

    def visit(self, m: nn.Module, name: str) -> nn.Module:
        """``m``'s replacement (``m`` itself if none), with those below it listed in ``pending``."""
        if id(m) in self.done:
            return self.done[id(m)]
        try:
            new = self.swap(m)
        except ValueError as e:
            raise ValueError(f"{_shown(name)}: {e}") from e
        if new is not None:
            _warn_lost_hooks(m, name)
            self.swapped.append(_shown(name))
        else:
            new = m
            if self.left_alone(m):
                self.skipped.append(f"{_shown(name)} ({type(m).__module__}.{type(m).__qualname__})")
            else:
                # every name of every child: named_children() lists a child registered under two names
                # once, and its second name would keep the old module
                for child_name, child in m._modules.items():
                    if child is None:
                        continue
                    replaced = self.visit(child, f"{name}.{child_name}" if name else child_name)
                    if replaced is not child:
                        self.pending.append((m, child_name, replaced))
        self.done[id(m)] = new
        return new

    def apply(self) -> None:
        for parent, child_name, new in self.pending:
            parent.add_module(child_name, new)


def _shown(name: str) -> str:
    return name or "(the model itself)"


def _warn_lost_hooks(m: nn.Module, name: str) -> None:
    hooks = {
        "forward": m._forward_hooks,
        "forward pre": [h for h in m._forward_pre_hooks.values() if h is not _always_call_me],
        "backward": m._backward_hooks,
        "backward pre": m._backward_pre_hooks,
    }
    kinds = [kind for kind, found in hooks.items() if found]
    if kinds:
        logger.warning(
            "%s: its %s hooks are not carried to the replacement; register them on the returned model",
            _shown(name),
            " and ".join(kinds),
        )


def _adopt(new: nn.Module, old: nn.Module) -> nn.Module:
    """``new`` (built on the meta device with ``old``'s flags) takes ``old``'s own Parameter objects: the
    exact tensors, ``requires_grad``, device and dtype, and references an optimizer holds. Also ``old``'s
    train/eval mode. The two classes have the same parameter names and shapes for the same flags."""
    params = dict(old.named_parameters(remove_duplicate=False))
    mine = dict(new.named_parameters(remove_duplicate=False))
    theirs, ours = ({n: tuple(p.shape) for n, p in d.items()} for d in (params, mine))
    if theirs != ours:  # a subclass of nn.MultiheadAttention with parameters of its own (subclasses=True)
        raise ValueError(
            f"{type(old).__name__} has parameters {theirs}, {type(new).__name__} has {ours}; it cannot be "
            f"replaced with its weights kept: convert without subclasses=True to leave it alone"
        )
    for name, p in params.items():
        owner, _, leaf = name.rpartition(".")
        setattr(new.get_submodule(owner), leaf, p)
    return new.train(old.training)


def _on_meta(m: nn.Module) -> dict[str, object]:
    """``m``'s constructor flags, on the meta device: the new module allocates and initialises nothing,
    since :func:`_adopt` hands it ``m``'s parameters."""
    return {**_flags(m), "device": "meta"}


def _check(model: object, inplace: object, **flags: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for name, value in {"inplace": inplace, **flags}.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")


def _run(model: nn.Module, walk: _Walk, inplace: bool, what: str) -> tuple[nn.Module, _Walk]:
    root = walk.visit(model if inplace else copy.deepcopy(model), "")
    walk.apply()
    if walk.swapped:
        logger.info("%s %d module(s): %s", what, len(walk.swapped), ", ".join(walk.swapped))
    else:
        logger.info("%s nothing: the model holds no such module", what)
    return root, walk


def convert(model: nn.Module, *, inplace: bool = False, subclasses: bool = False) -> nn.Module:
    """Every ``torch.nn.MultiheadAttention`` in ``model`` replaced by the drop-in
    :class:`~multihead.compat.torch.MultiheadAttention`; returns the model.

    Args:
        model: any ``nn.Module``: a torchvision ``VisionTransformer``, an open_clip model, an
            ``nn.Transformer``, your own model with ``nn.TransformerEncoder`` inside.
        inplace: change ``model`` itself (its Parameter objects move into the drop-ins) instead of a deep
            copy. The model itself, if it is an ``nn.MultiheadAttention``, is replaced either way: use the
            return value.
        subclasses: also convert subclasses of ``nn.MultiheadAttention`` (their overrides are dropped: the
            drop-in runs torch's semantics) and look inside subclasses of torch's Transformer classes.
            By default both are left alone, with what is inside them, and named in a warning.

    Weights stay exact (the same tensors), ``state_dict`` keys and shapes stay (``load_state_dict(...,
    strict=True)`` works both ways), and so do train/eval, ``requires_grad``, device and dtype. torch's
    Transformer layers and stacks keep their code and call the drop-in in every mode. Logs (``logging``,
    logger ``multihead.compat.torch.convert``) the names of the modules it replaced at INFO and of those
    it left alone at WARNING. :func:`revert` undoes it.
    """
    _check(model, inplace, subclasses=subclasses)

    def swap(m: nn.Module) -> nn.Module | None:
        if type(m) is nn.MultiheadAttention or (subclasses and isinstance(m, nn.MultiheadAttention)):
            return _adopt(MultiheadAttention(m.embed_dim, m.num_heads, **_on_meta(m)), m)
        return None

    def left_alone(m: nn.Module) -> bool:
        return not subclasses and isinstance(m, TORCH_CLASSES) and type(m) not in TORCH_CLASSES

    root, walk = _run(model, _Walk(swap, left_alone), inplace, "convert: nn.MultiheadAttention -> drop-in,")
    if walk.skipped:
        logger.warning(
            "convert left %d subclass(es) of torch's classes alone, with what is inside them (their own code "
            "may read the attention's weights past its forward): %s; pass subclasses=True to convert them too",
            len(walk.skipped),
            ", ".join(walk.skipped),
        )
    return root


def revert(model: nn.Module, *, inplace: bool = False) -> nn.Module:
    """Undo :func:`convert`: every drop-in :class:`~multihead.compat.torch.MultiheadAttention` in ``model``
    back to a ``torch.nn.MultiheadAttention`` with the same Parameter objects, flags and mode; returns
    the model.

    ``inplace`` as in :func:`convert`. A drop-in whose heads were pruned (:func:`multihead.heads.prune`)
    has no torch equivalent: ValueError naming it. Subclasses of the drop-in are left alone and named in
    a warning. Works on any model holding drop-ins, whether :func:`convert` put them there or not.
    """
    _check(model, inplace)

    def swap(m: nn.Module) -> nn.Module | None:
        if type(m) is not MultiheadAttention:
            return None
        return _adopt(nn.MultiheadAttention(m.embed_dim, m.num_heads, **_on_meta(m)), m)

    def left_alone(m: nn.Module) -> bool:
        return isinstance(m, MultiheadAttention)

    pruned = [_shown(n) for n, m in model.named_modules() if type(m) is MultiheadAttention and m.pruned()]
    if pruned:  # checked before anything changes, so an inplace revert is all or nothing
        raise ValueError(
            f"revert: {', '.join(pruned)} lost heads to pruning; torch.nn.MultiheadAttention needs num_heads * "
            f"head_dim == embed_dim, so these can only stay multihead.compat.torch.MultiheadAttention"
        )
    root, walk = _run(model, _Walk(swap, left_alone), inplace, "revert: drop-in -> nn.MultiheadAttention,")
    if walk.skipped:
        logger.warning(
            "revert left %d subclass(es) of the drop-in alone: %s", len(walk.skipped), ", ".join(walk.skipped)
        )
    return root
