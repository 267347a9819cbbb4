"""ONNX export with dynamic batch and sequence axes, checked with onnxruntime.

Dimensions: B batch, Lq/Lk query/key lengths, E features.

:func:`to_onnx` exports any module of this library (``MultiHeadAttention``, the Transformer blocks)
through ``torch.onnx.export(..., dynamo=True)`` -- torch's ``torch.export`` based exporter, which needs
``onnxscript``; the legacy TorchScript exporter cannot pass keyword masks such as ``valid_lens``. Every
input axis is dynamic except a float input's last (feature) axis and axes of size 1; the graph's axis
names become ``batch`` and ``len0``, ``len1``, ... (tied axes share a name). :func:`verify_onnx` runs the
file in onnxruntime on inputs with new batch sizes and lengths and compares with the eager module.

Needs the optional extra ``multihead[onnx]`` (onnx, onnxruntime, onnxscript); importing this module
does not import them.
"""

from __future__ import annotations

import argparse
import inspect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from ._extras import require

__all__ = ["ExportReport", "example_inputs", "load_trained", "to_onnx", "verify_onnx"]

#: (batch delta, length delta) of the inputs :func:`verify_onnx` builds beyond the example's own shapes.
VERIFY_DELTAS = ((1, 2), (2, 5))


class _Positional(nn.Module):
    """Calls ``module(*args, **{name: tensor})`` from positional tensors (ONNX inputs are positional)."""

    def __init__(self, module: nn.Module, n_args: int, kw_names: Sequence[str]) -> None:
        super().__init__()
        self.module = module
        self.n_args = n_args
        self.kw_names = list(kw_names)

    def forward(self, *tensors: Tensor) -> Tensor:
        kwargs = dict(zip(self.kw_names, tensors[self.n_args :]))
        out = self.module(*tensors[: self.n_args], **kwargs)
        return out.output if hasattr(out, "output") else out  # AttentionOutput -> its output


def _is_counts(name: str) -> bool:
    """``valid_lens`` style inputs hold counts, even as floats (d2l/DJL pass them as float)."""
    return name.endswith("valid_lens")


def _dynamic_axes(t: Tensor, *, counts: bool = False) -> list[int]:
    """Axes to export as dynamic: all but a float tensor's feature axis, and none of size 1.

    ``counts``: ``t`` holds lengths (``valid_lens``): every axis is dynamic whatever its dtype.
    """
    last = t.dim() - 1 if t.is_floating_point() and not counts else t.dim()
    return [a for a in range(last) if t.shape[a] != 1]


def _as_args(example_input: Tensor | Sequence[Tensor]) -> tuple[Tensor, ...]:
    return (example_input,) if isinstance(example_input, Tensor) else tuple(example_input)


def _input_names(module: nn.Module, n_args: int, kw_names: Sequence[str]) -> list[str]:
    params = [
        p.name
        for p in inspect.signature(module.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    names = params[:n_args] + [f"input{i}" for i in range(len(params), n_args)]
    return names + list(kw_names)


def _rename_dims(path: Path) -> dict[str, list[str | int]]:
    """Give the graph's symbolic axes readable names (batch, len0, len1, ...); return the input shapes."""
    import onnx

    model = onnx.load(str(path))
    names: dict[str, str] = {}
    for vi in list(model.graph.input) + list(model.graph.output):
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.dim_param and d.dim_param not in names:
                names[d.dim_param] = "batch" if axis == 0 and not names else f"len{len(names) - 1}"
    for vi in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param in names:
                d.dim_param = names[d.dim_param]
    onnx.save(model, str(path))
    return {
        vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
        for vi in model.graph.input
    }


@dataclass
class ExportReport:
    """What :func:`to_onnx` did."""

    path: Path
    inputs: dict[str, list[str | int]]  # graph input name -> shape, symbolic axes named batch, len0, ...
    max_error: float | None = None  # largest |onnxruntime - eager| over the verified shapes
    shapes: list[list[int]] = field(default_factory=list)  # first input's shape in each verified run


def to_onnx(
    module: nn.Module,
    example_input: Tensor | Sequence[Tensor],
    path: str | Path,
    *,
    example_kwargs: Mapping[str, Tensor] | None = None,
    opset: int = 18,
    verify: bool = True,
    atol: float = 1e-5,
) -> ExportReport:
    """Export ``module`` to ONNX at ``path`` with dynamic batch and sequence axes.

    Args:
        module: e.g. ``MultiHeadAttention`` (put in eval mode for the export).
        example_input: the positional inputs, e.g. ``query`` (B, Lq, E) or ``(query, key, value)``.
            Use B >= 2 and lengths >= 2 (axes of size 1 are exported as fixed).
        path: the ``.onnx`` file to write.
        example_kwargs: keyword tensor inputs, e.g. ``{"valid_lens": (B,) long}``; they become graph
            inputs after the positional ones.
        opset: ONNX opset version.
        verify: run :func:`verify_onnx` (needs onnxruntime) and raise if the error exceeds ``atol``.

    Returns an :class:`ExportReport`.
    """
    require("onnx", ("onnx", "onnxscript", *(("onnxruntime",) if verify else ())), "ONNX export")
    args = _as_args(example_input)
    kwargs = dict(example_kwargs or {})
    for name, t in [*((f"example_input[{i}]", a) for i, a in enumerate(args)), *kwargs.items()]:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    wrapper = _Positional(module, len(args), list(kwargs)).eval()
    tensors = (*args, *kwargs.values())
    auto = torch.export.Dim.AUTO
    names = _input_names(module, len(args), list(kwargs))
    dynamic = tuple({a: auto for a in _dynamic_axes(t, counts=_is_counts(n))} for n, t in zip(names, tensors))
    with torch.no_grad():
        torch.onnx.export(
            wrapper,
            tensors,
            str(path),
            dynamo=True,
            dynamic_shapes=(dynamic,),  # one entry: the wrapper takes *tensors
            input_names=names,
            output_names=["output"],
            opset_version=opset,
            verbose=False,
        )
    report = ExportReport(path, _rename_dims(path))
    if verify:
        err, report.shapes = verify_onnx(path, module, args, kwargs)
        report.max_error = err
        if not err <= atol:
            raise RuntimeError(f"onnxruntime output differs from eager by {err:.3g} > atol={atol} ({path})")
    return report


def _resized(t: Tensor, db: int, dl: int, gen: torch.Generator, *, counts: bool = False) -> Tensor:
    """A fresh input like ``t`` with batch + db and every other dynamic axis + dl.

    Integer inputs and ``counts`` (lengths, any dtype) are drawn within ``t``'s value range.
    """
    shape = list(t.shape)
    for a in _dynamic_axes(t, counts=counts):
        shape[a] += db if a == 0 else dl
    if t.is_floating_point() and not counts:
        return torch.randn(shape, generator=gen, dtype=t.dtype)
    if t.dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.3
    lo, hi = (int(t.min()), int(t.max())) if t.numel() else (0, 1)
    return torch.randint(lo, hi + 1, shape, generator=gen).to(t.dtype)


def verify_onnx(
    path: str | Path,
    module: nn.Module,
    example_input: Tensor | Sequence[Tensor],
    example_kwargs: Mapping[str, Tensor] | None = None,
    *,
    seed: int = 0,
) -> tuple[float, list[list[int]]]:
    """Run ``path`` in onnxruntime on the example and on inputs with two other batch sizes and lengths.

    Integer inputs (``valid_lens``, token ids) are drawn within the example's value range; inputs that
    are one object in the example (``key is value``) stay one object. Returns the largest
    |onnxruntime - eager| and the input shapes tried.
    """
    import onnxruntime as ort

    args, kwargs = _as_args(example_input), dict(example_kwargs or {})
    wrapper = _Positional(module, len(args), list(kwargs)).eval()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    present = {i.name for i in session.get_inputs()}
    names = _input_names(module, len(args), list(kwargs))
    gen = torch.Generator().manual_seed(seed)
    example = (*args, *kwargs.values())
    worst, shapes = 0.0, []
    for db, dl in ((0, 0), *VERIFY_DELTAS):
        fresh: dict[int, Tensor] = {}  # one new tensor per example object: `key is value` stays true
        for n, t in zip(names, example):
            fresh.setdefault(
                id(t), t if (db, dl) == (0, 0) else _resized(t, db, dl, gen, counts=_is_counts(n))
            )
        tensors = tuple(fresh[id(t)] for t in example)
        with torch.no_grad():
            eager = wrapper(*tensors).numpy()
        (got,) = session.run(["output"], {n: t.numpy() for n, t in zip(names, tensors) if n in present})
        worst = max(worst, float(abs(got - eager).max()))
        shapes.append(list(tensors[0].shape))
    return worst, shapes


# ----------------------------------------------------------------------------------------------
# `multihead export`
# ----------------------------------------------------------------------------------------------


EXAMPLES = """\
examples:
  multihead export                                  random MultiHeadAttention(64, 4) -> multihead.onnx
  multihead export --model transformer --out t.onnx
  multihead export --checkpoint demo-out/model_pruned.pt --out dates.onnx
                                                    the demo's trained (pruned) Transformer; its
                                                    config is demo-out/config.json
  multihead export --checkpoint my.safetensors --config my.json

A --config file is JSON: {"model": {"class": "Transformer" or "MultiHeadAttention", "kwargs": {...}}},
the constructor's arguments (the demo's config.json has this entry). The ONNX file is checked in
onnxruntime against PyTorch (max |diff| <= 1e-5) on three batch sizes and lengths.
Needs the extra multihead[onnx]."""

#: The classes ``--config`` may name, each with its example inputs (see :func:`example_inputs`).
EXPORTABLE = ("MultiHeadAttention", "Transformer")


def add_cli(sub: argparse._SubParsersAction) -> None:
    """Register the ``export`` subcommand on the ``multihead`` command's subparsers."""
    p = sub.add_parser(
        "export",
        help="export a model (trained, or random weights) to ONNX and verify it in onnxruntime",
        description="Export MultiHeadAttention or the Transformer to ONNX with dynamic batch and lengths: "
        "a trained model from --checkpoint, or one with random weights.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--checkpoint", metavar="PATH", help="a trained model's weights (.pt or .safetensors)")
    p.add_argument(
        "--config", metavar="CONFIG", help="JSON with the model's class and arguments (default: config.json "
        "beside the checkpoint)"
    )  # fmt: skip
    random_weights = p.add_argument_group("random weights (without --checkpoint)")
    random_weights.add_argument("--model", choices=["mha", "transformer"], help="default: mha")
    random_weights.add_argument("--embed-dim", type=int, help="default: 64")
    random_weights.add_argument("--heads", type=int, help="default: 4")
    random_weights.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--batch", type=int, default=2, help="example batch size (>= 2; the axis stays dynamic)")
    p.add_argument("--len", type=int, default=5, help="example query (target) length (>= 2)")
    p.add_argument("--kv-len", type=int, default=7, help="example key/value (source) length (>= 2)")
    p.add_argument("--no-valid-lens", action="store_true", help="no valid_lens input")
    p.add_argument("--opset", type=int, default=18)
    p.add_argument("--out", default="multihead.onnx", help="the .onnx file to write")
    p.set_defaults(check_args=_check_args)


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors the parser cannot see on its own (exit 2 through ``parser.error``)."""
    chosen = [
        f"--{n.replace('_', '-')}" for n in ("model", "embed_dim", "heads") if getattr(args, n) is not None
    ]
    if args.checkpoint is None and args.config is not None:
        parser.error("--config goes with --checkpoint (it describes the checkpoint's model)")
    if args.checkpoint is not None and chosen:
        parser.error(f"{', '.join(chosen)}: the model comes from --checkpoint and its config; drop them")
    for name in ("batch", "len", "kv_len"):
        if getattr(args, name) < 2:
            parser.error(f"--{name.replace('_', '-')} must be >= 2 (an axis of size 1 is exported as fixed)")


def load_trained(checkpoint_path: str | Path, config: str | Path | None = None) -> nn.Module:
    """The model saved at ``checkpoint_path``, rebuilt from ``config`` and loaded safely, in eval mode.

    ``config``: JSON ``{"model": {"class": "Transformer" | "MultiHeadAttention", "kwargs": {...}}}``
    (default: ``config.json`` beside the checkpoint, as the demo writes it). Pruned checkpoints are
    resized on load (:func:`multihead.checkpoint.load_model`). Raises :class:`multihead.checkpoint.CheckpointError`
    for a config that does not describe a model.
    """
    import multihead

    from .checkpoint import CheckpointError, load_model

    checkpoint_path = Path(checkpoint_path)
    if not checkpoint_path.is_file():
        raise FileNotFoundError(f"no checkpoint file {str(checkpoint_path)!r}")
    config = Path(config) if config is not None else checkpoint_path.with_name("config.json")
    if not config.is_file():
        raise FileNotFoundError(
            f"no config file {str(config)!r}: pass --config with the model's class and arguments"
        )
    try:
        spec = json.loads(config.read_text())["model"]
        cls, kwargs = spec["class"], dict(spec["kwargs"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f'{config}: expected JSON {{"model": {{"class": ..., "kwargs": {{...}}}}}}, failed at {e!r}'
        ) from e
    if cls not in EXPORTABLE:
        raise CheckpointError(f"{config}: model class {cls!r} is not one of {list(EXPORTABLE)}")
    try:
        model = getattr(multihead, cls)(**kwargs)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{config}: {cls}(**kwargs) failed: {e}") from e
    try:
        return load_model(model, checkpoint_path).eval()
    except (RuntimeError, ValueError) as e:  # shapes or names that do not fit the configured model
        if isinstance(e, CheckpointError):
            raise
        first = str(e).strip().splitlines()[0]
        raise CheckpointError(
            f"{checkpoint_path} does not fit the {cls} that {config} describes: {first}"
        ) from e


def example_inputs(
    module: nn.Module,
    *,
    batch: int = 2,
    length: int = 5,
    kv_length: int = 7,
    valid_lens: bool = True,
    seed: int = 0,
) -> tuple[tuple[Tensor, ...], dict[str, Tensor]]:
    """Example inputs for exporting ``module`` (a ``Transformer`` or ``MultiHeadAttention``).

    Transformer: ``(src (B, kv_length), tgt (B, length))`` token ids in ``[1, vocab)`` and
    ``{"src_valid_lens": (B,)}``; MultiHeadAttention: ``(query (B, length, E), key (B, kv_length, kdim))``
    (value = key when kdim == vdim, else a third tensor (B, kv_length, vdim)) and ``{"valid_lens": (B,)}``.
    """
    import multihead

    gen = torch.Generator().manual_seed(seed)
    b, lq, lk = batch, length, kv_length
    lens = torch.arange(b) % lk + 1  # (B,): 1, 2, ... valid keys
    if isinstance(module, multihead.Transformer):
        src = torch.randint(1, max(2, module.src_vocab), (b, lk), generator=gen)  # (B, S)
        tgt = torch.randint(1, max(2, module.tgt_vocab), (b, lq), generator=gen)  # (B, T)
        return (src, tgt), ({"src_valid_lens": lens} if valid_lens else {})
    if isinstance(module, multihead.MultiHeadAttention):
        x = torch.randn(b, lq, module.embed_dim, generator=gen)
        key = torch.randn(b, lk, module.kdim, generator=gen)
        value = () if module.vdim == module.kdim else (torch.randn(b, lk, module.vdim, generator=gen),)
        return (x, key, *value), ({"valid_lens": lens} if valid_lens else {})
    raise TypeError(f"module must be a Transformer or MultiHeadAttention, got {type(module).__name__}")


def _random_module(args: argparse.Namespace) -> nn.Module:
    """The module ``multihead export`` exports without ``--checkpoint``: random weights from ``--seed``."""
    import multihead

    torch.manual_seed(args.seed)
    e, h = args.embed_dim or 64, args.heads or 4
    if (args.model or "mha") == "transformer":
        return multihead.Transformer(50, 50, d_model=e, num_heads=h, num_encoder_layers=2, num_decoder_layers=2,
                                     d_ff=2 * e, dropout=0.0).eval()  # fmt: skip
    return multihead.MultiHeadAttention(e, h).eval()


def _example(args: argparse.Namespace) -> tuple[nn.Module, tuple[Tensor, ...], dict[str, Tensor]]:
    """The module and example inputs the ``export`` subcommand exports."""
    if args.checkpoint is not None:
        module = load_trained(args.checkpoint, args.config)
    else:
        module = _random_module(args)
    inputs, kwargs = example_inputs(
        module, batch=args.batch, length=args.len, kv_length=args.kv_len, valid_lens=not args.no_valid_lens,
        seed=args.seed,
    )  # fmt: skip
    return module, inputs, kwargs


def run_cli(args: argparse.Namespace) -> int:
    """``multihead export``: write the ONNX file, verify it in onnxruntime, print what the graph takes."""
    require("onnx", ("onnx", "onnxruntime", "onnxscript"), "ONNX export")  # before loading anything
    module, inputs, kwargs = _example(args)
    source = args.checkpoint or f"random weights, seed {args.seed}"
    print(f"exporting {type(module).__name__} ({source}) -> {args.out} (opset {args.opset}) ...", flush=True)
    report = to_onnx(module, inputs, args.out, example_kwargs=kwargs, opset=args.opset)
    for name, shape in report.inputs.items():
        print(f"  input {name:<14} {shape}")
    tried = ", ".join("x".join(map(str, s)) for s in report.shapes)
    print(f"onnxruntime vs eager on {tried}: max |diff| = {report.max_error:.2e} (OK, <= 1e-5)")
    return 0
