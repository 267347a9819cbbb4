"""Safe checkpoints: save a model's weights and load them back without running pickled code.

Dimensions: H query heads, Hkv key/value heads of an attention module.

The format follows the file's suffix:

* ``.safetensors`` (the optional extra ``multihead[safetensors]``): raw tensors and string metadata, no code
  at all. :func:`save` records each attention module's head counts (H, Hkv) in the metadata, so a pruned
  model reloads into a freshly built one without inferring them from tensor shapes; tied weights are
  stored once and restored as one tensor.
* anything else (``.pt``, ``.pth``): ``torch.save(model.state_dict(), path)``, a plain state dict, read back
  with ``torch.load(path, weights_only=True)``: only tensors and plain containers are rebuilt and any
  other pickled object is refused (on torch < 2.6 ``torch.load`` without ``weights_only=True`` runs
  whatever code the file names).

::

    checkpoint.save(pruned, "pruned.safetensors")           # or "pruned.pt"
    model = checkpoint.load_model(Transformer(...same arguments...), "pruned.safetensors")
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor, nn

from ._extras import require
from .heads import attention_modules, load_pruned

__all__ = ["Checkpoint", "CheckpointError", "head_counts", "load", "load_model", "save"]

#: Metadata keys this module writes (values are strings, as safetensors requires).
HEADS_KEY = "multihead.heads"  # JSON {module name: [H, Hkv]}
ALIASES_KEY = "multihead.aliases"  # JSON {name of a tied tensor: name it is stored under}
VERSION_KEY = "multihead.version"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: not a state dict, refused by the safe loader, bad metadata."""


@dataclass
class Checkpoint:
    """What :func:`load` read: the state dict and the file's metadata (empty for ``.pt`` files)."""

    state_dict: dict[str, Tensor]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def head_counts(self) -> dict[str, tuple[int, int]] | None:
        """``{attention module name: (H, Hkv)}`` as saved, or ``None`` when the file does not say."""
        raw = self.metadata.get(HEADS_KEY)
        if raw is None:
            return None
        try:
            return {name: (int(h), int(hkv)) for name, (h, hkv) in json.loads(raw).items()}
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"metadata {HEADS_KEY!r} is not {{name: [H, Hkv]}}: {raw[:80]!r}") from e


def head_counts(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{name: (H, Hkv)}`` of every :class:`~multihead.MultiHeadAttention` in ``model`` (``""`` for itself)."""
    return {name: (m.num_heads, m.kv_heads) for name, m in attention_modules(model).items()}


def _is_safetensors(path: Path) -> bool:
    return path.suffix == ".safetensors"


def _safetensors() -> ModuleType:
    require("safetensors", ("safetensors.torch",), ".safetensors checkpoint files")
    import safetensors.torch

    return safetensors.torch


def _untie(state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Store each tensor once: ``(tensors, {alias: stored name})``; safetensors refuses shared memory."""
    tensors: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    views: dict[tuple, str] = {}  # (storage, offset, shape, stride, dtype) -> first name
    storages: set[int] = set()
    for name, t in state.items():
        t = t.detach()
        ptr = t.untyped_storage().data_ptr()
        view = (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and view in views:
            aliases[name] = views[view]  # the same tensor under a second name (tied weights)
            continue
        views[view] = name
        shared = t.numel() > 0 and ptr in storages  # another view of a stored tensor's memory
        storages.add(ptr)
        tensors[name] = t.clone() if shared or not t.is_contiguous() else t
    return tensors, aliases


def save(model: nn.Module, path: str | Path, *, metadata: Mapping[str, str] | None = None) -> Path:
    """Save ``model.state_dict()`` to ``path``; the format follows the suffix (see the module docstring).

    Args:
        model: any module; pruned models included.
        path: ``*.safetensors`` (needs ``multihead[safetensors]``) or ``*.pt``/``*.pth``.
        metadata: extra string entries for a ``.safetensors`` file's metadata (keys starting with
            ``multihead.`` are reserved). ``.pt`` files hold the plain state dict and no metadata.

    Returns the path written.
    """
    path = Path(path)
    state = model.state_dict()
    if not _is_safetensors(path):
        if metadata:
            raise ValueError(
                f"metadata is stored only in .safetensors files, got path {str(path)!r}: "
                f"save to {path.with_suffix('.safetensors').name!r} or drop metadata="
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
        return path
    user = dict(metadata or {})
    bad = [k for k, v in user.items() if not (isinstance(k, str) and isinstance(v, str))]
    if bad:
        raise TypeError(f"metadata must map str to str (safetensors' format); not strings: {bad[:3]}")
    reserved = [k for k in user if k.startswith("multihead.")]
    if reserved:
        raise ValueError(f"metadata keys starting with 'multihead.' are reserved, got {reserved}")
    from . import __version__

    st = _safetensors()
    tensors, aliases = _untie(state)
    meta = {
        **user,
        HEADS_KEY: json.dumps({name: list(c) for name, c in head_counts(model).items()}),
        ALIASES_KEY: json.dumps(aliases),
        VERSION_KEY: __version__,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    st.save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)
    return path


def load(path: str | Path, *, map_location: str | torch.device = "cpu") -> Checkpoint:
    """Read a checkpoint written by :func:`save` (or any ``torch.save(state_dict)`` file) safely.

    ``.pt`` files go through ``torch.load(path, map_location=..., weights_only=True)``: a file that holds
    anything but tensors and plain containers is refused with :class:`CheckpointError`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file {str(path)!r}")
    if _is_safetensors(path):
        _safetensors()
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt", device=str(map_location)) as f:
                metadata = dict(f.metadata() or {})
                state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        except Exception as e:  # safetensors raises its own SafetensorError for a damaged file
            raise CheckpointError(f"{path}: not a readable .safetensors file ({e})") from e
        try:
            aliases = json.loads(metadata.get(ALIASES_KEY, "{}"))
        except ValueError as e:
            raise CheckpointError(f"{path}: metadata {ALIASES_KEY!r} is not JSON") from e
        for alias, name in aliases.items():
            state[alias] = state[name]
        return Checkpoint(state, metadata)
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refused by torch.load(weights_only=True): the file holds objects other than tensors "
            f"(a pickled model or arbitrary code). Load it only if you trust its source, then save "
            f"model.state_dict() instead. ({str(e).splitlines()[0]})"
        ) from e
    if not isinstance(obj, Mapping) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise CheckpointError(
            f"{path}: expected a state dict {{name: tensor}}, got {type(obj).__name__}; "
            f"save model.state_dict(), not the model or a dict of other things"
        )
    return Checkpoint(dict(obj))


def load_model(
    model: nn.Module, path: str | Path, *, strict: bool = True, map_location: str | torch.device = "cpu"
) -> nn.Module:
    """Load ``path`` into ``model``, a freshly built model of the checkpoint's configuration; returns it.

    A pruned checkpoint resizes ``model``'s attention modules first (:func:`multihead.heads.load_pruned`),
    with the head counts from a ``.safetensors`` file's metadata or, for ``.pt`` files, from the shapes.
    """
    ckpt = load(path, map_location=map_location)
    return load_pruned(model, ckpt.state_dict, strict=strict, head_counts=ckpt.head_counts)
