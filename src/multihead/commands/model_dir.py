"""Load a local Hugging Face checkpoint folder (config, weights, tokenizer) on multihead's attention.

The shared loader of ``multihead view`` and ``multihead prune``. :func:`check_folder` validates a folder
without importing transformers (so a wrong path fails in milliseconds), :func:`detect_kind` reads what
the checkpoint is from its config, and :func:`load` builds the model with ``attn_implementation=
"multihead"`` from local files only (never the network), pruned folders included.

Kinds: ``"encoder"`` (a bare encoder such as ``BertModel``), ``"masked-lm"``, ``"causal-lm"``,
``"decoder"`` (a bare decoder-only model such as ``GPT2Model``: causal, no LM head) and
``"encoder-decoder"``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "KINDS",
    "BadInput",
    "CheckpointFolder",
    "NotACheckpoint",
    "check_folder",
    "detect_kind",
    "load",
]

KINDS = ("encoder", "masked-lm", "causal-lm", "decoder", "encoder-decoder")

_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model")
_NO_LIMIT = 1_000_000  # transformers' "no limit" model_max_length is ~1e30


class BadInput(ValueError):
    """A usage error of a checkpoint command (a bad folder, text or path): the CLI prints its one-line
    message and exits with status 2."""


class NotACheckpoint(BadInput):
    """The folder is not a loadable checkpoint; the message is one line naming the folder and the cause."""


@dataclass(frozen=True)
class CheckpointFolder:
    """A loaded checkpoint: the model (eval mode, on multihead), its tokenizer, config, kind and folder.

    ``max_length`` is the most tokens the model takes in one sequence (its position table or its
    tokenizer's ``model_max_length``, the smaller), or None when neither sets a limit.
    """

    model: Any
    tokenizer: Any
    config: Any
    kind: str
    path: Path
    max_length: int | None


@contextmanager
def quiet_tokenizer() -> Iterator[None]:
    """Tokenize without transformers' "sequence length is longer than" warning: the commands check each
    text's length against the model's and say it themselves, in their one line on stderr."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)


def check_folder(path: str | Path) -> dict[str, Any]:
    """Validate ``path`` as a checkpoint folder and return its ``config.json`` as a dict.

    Raises:
        NotACheckpoint: no such directory, no ``config.json`` (or not JSON), no weights file, no tokenizer.
    """
    folder = Path(path)
    where = f"not a checkpoint folder: {folder}"
    if not folder.exists():
        raise NotACheckpoint(f"{where} (no such directory)")
    if not folder.is_dir():
        raise NotACheckpoint(f"{where} (a file, not a directory; pass the folder save_pretrained wrote)")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise NotACheckpoint(f"{where} (no config.json)")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NotACheckpoint(f"{where} (config.json is not valid JSON: {e})") from e
    if not isinstance(config, dict) or "model_type" not in config:
        raise NotACheckpoint(f"{where} (config.json has no model_type: not a transformers config)")
    if not any((folder / name).is_file() for name in _WEIGHTS):
        raise NotACheckpoint(f"{where} (no weights: expected one of {', '.join(_WEIGHTS)})")
    if not any((folder / name).is_file() for name in _TOKENIZER):
        raise NotACheckpoint(f"{where} (no tokenizer: expected tokenizer.json or tokenizer_config.json)")
    return config


def detect_kind(config: dict[str, Any]) -> str:
    """The kind of a checkpoint (one of :data:`KINDS`) from its config dict's ``architectures``.

    ``...ForConditionalGeneration`` or ``is_encoder_decoder`` -> ``"encoder-decoder"``; ``...ForMaskedLM``
    -> ``"masked-lm"``; ``...ForCausalLM`` / ``...LMHeadModel`` -> ``"causal-lm"``; anything else (a bare
    ``...Model``, a classifier) -> ``"decoder"`` for a decoder-only family (one transformers has causal
    but no masked language models for), else ``"encoder"``.
    """
    arch = (config.get("architectures") or [""])[0]
    if config.get("is_encoder_decoder") or arch.endswith("ForConditionalGeneration"):
        return "encoder-decoder"
    if arch.endswith("ForMaskedLM"):
        return "masked-lm"
    if arch.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal-lm"
    from transformers.models.auto import modeling_auto as auto

    model_type = config.get("model_type")
    causal_only = (
        model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and model_type not in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    )
    return "decoder" if causal_only or config.get("is_decoder") else "encoder"


def _model_class(config: dict[str, Any], kind: str, folder: Path) -> Any:
    import transformers

    arch = (config.get("architectures") or [None])[0]
    if arch is None:
        auto = {"masked-lm": "AutoModelForMaskedLM", "causal-lm": "AutoModelForCausalLM"}
        return getattr(transformers, auto.get(kind, "AutoModel"))
    cls = getattr(transformers, arch, None)
    if cls is None:
        raise NotACheckpoint(
            f"not a checkpoint folder multihead can load: {folder} (architecture {arch} is not in "
            f"transformers {transformers.__version__})"
        )
    return cls


def _max_length(config: Any, tokenizer: Any) -> int | None:
    limits = [
        getattr(config, "max_position_embeddings", None),
        getattr(config, "n_positions", None),
        getattr(tokenizer, "model_max_length", None),
    ]
    limits = [int(v) for v in limits if isinstance(v, int) and 0 < v < _NO_LIMIT]
    return min(limits) if limits else None


def load(path: str | Path) -> CheckpointFolder:
    """Load the checkpoint folder ``path`` on multihead attention, from local files only.

    Returns a :class:`CheckpointFolder` whose model is in eval mode, float32, on the CPU, and runs every
    attention call through multihead (so ``viz.capture`` and ``heads.importance`` work on it). A folder
    pruned by ``multihead prune`` / ``heads.prune`` loads at its pruned head counts.

    Raises:
        NotACheckpoint: the folder is not a checkpoint (see :func:`check_folder`), names an architecture
            transformers lacks, or its files fail to load (the message keeps transformers' first line).
        multihead._extras.MissingExtra: transformers is not installed.
    """
    from .._extras import require

    require("transformers", ("transformers",), "loading a Hugging Face checkpoint folder")
    folder = Path(path)
    raw = check_folder(folder)
    kind = detect_kind(raw)
    import torch
    import transformers

    from ..integrations import transformers as mhtf

    name = mhtf.register()
    cls = _model_class(raw, kind, folder)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar on the command's output
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = mhtf.from_pretrained(
            cls, folder, attn_implementation=name, local_files_only=True, dtype=torch.float32
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NotACheckpoint(f"not a loadable checkpoint folder: {folder} ({first})") from e
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    model.eval()
    return CheckpointFolder(
        model, tokenizer, model.config, kind, folder, _max_length(model.config, tokenizer)
    )
