"""The demo's configuration, its model, and the files it saves the trained models in.

What :func:`save_models` writes under the output folder, and what ``multihead export --checkpoint`` reads:

* ``model.pt`` and ``model_pruned.pt``: plain state dicts (``torch.save(model.state_dict())``), read back
  with ``torch.load(path, weights_only=True)`` (:func:`multihead.checkpoint.load`);
* ``config.json``: ``{"model": {"class": "Transformer", "kwargs": {...}}, "demo": {...}, "src_vocab": [...],
  "tgt_vocab": [...], "pruned": {module: [heads removed]}}``: ``Transformer(**kwargs)`` rebuilds the
  unpruned architecture, :func:`multihead.checkpoint.load_model` resizes it to a pruned checkpoint
  (:func:`multihead.export.load_trained` does both).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from torch import nn

from .. import checkpoint
from ..transformer import Transformer
from .data import PAD, Dataset

__all__ = ["CONFIG_NAME", "DemoConfig", "SavedModels", "build_model", "model_kwargs", "save_models"]

CONFIG_NAME = "config.json"


@dataclass
class DemoConfig:
    """Everything the demo's numbers depend on (the defaults are the README's run)."""

    seed: int = 0
    data: str | None = None  # a TSV file of source<TAB>target pairs instead of the date task
    d_model: int = 64
    num_heads: int = 4
    layers: int = 2  # encoder layers = decoder layers
    d_ff: int = 128
    dropout: float = 0.0
    steps: int = 900
    batch_size: int = 128
    lr: float = 3e-3
    warmup: int = 100
    train_size: int = 20000
    dev_size: int = 1000
    test_size: int = 1000
    curve_points: int = 6  # dev accuracy checks during training (for the curve)
    prune_step: float = 0.1  # fraction of all heads per pruning step
    prune_budget: float = 1.0  # accuracy points the pruned model may lose (on dev)
    drop_size: int = 300  # dev examples per masking-drop evaluation
    prune_patience: int = 6  # single-head rejections in a row before pruning stops
    speed_repeats: int = 3
    report_examples: int = 3


def model_kwargs(cfg: DemoConfig, ds: Dataset) -> dict[str, object]:
    """The :class:`~multihead.Transformer` arguments of the demo's model for ``ds``'s vocabularies."""
    return {
        "src_vocab": len(ds.src_vocab),
        "tgt_vocab": len(ds.tgt_vocab),
        "d_model": cfg.d_model,
        "num_heads": cfg.num_heads,
        "num_encoder_layers": cfg.layers,
        "num_decoder_layers": cfg.layers,
        "d_ff": cfg.d_ff,
        "dropout": cfg.dropout,
        "max_len": 512,
        "pad_id": PAD,
    }


def build_model(cfg: DemoConfig, ds: Dataset) -> Transformer:
    """The demo's Transformer for ``ds``'s vocabularies (post-norm, as in the paper)."""
    return Transformer(**model_kwargs(cfg, ds))  # type: ignore[arg-type]


@dataclass
class SavedModels:
    """Paths :func:`save_models` wrote."""

    model: Path
    pruned: Path
    config: Path


def save_models(
    out: Path,
    cfg: DemoConfig,
    ds: Dataset,
    model: nn.Module,
    pruned: nn.Module,
    removed: dict[str, list[int]],
) -> SavedModels:
    """Write ``model.pt``, ``model_pruned.pt`` and ``config.json`` under ``out`` (see the module docstring)."""
    saved = SavedModels(out / "model.pt", out / "model_pruned.pt", out / CONFIG_NAME)
    checkpoint.save(model, saved.model)
    checkpoint.save(pruned, saved.pruned)
    config = {
        "model": {"class": "Transformer", "kwargs": model_kwargs(cfg, ds)},
        "demo": asdict(cfg),
        "src_vocab": ds.src_vocab.itos,
        "tgt_vocab": ds.tgt_vocab.itos,
        "pruned": removed,
    }
    saved.config.write_text(json.dumps(config, indent=1))
    return saved
