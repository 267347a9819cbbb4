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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

__all__ = ["ExportReport", "to_onnx", "verify_onnx"]

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


def add_cli(sub: argparse._SubParsersAction) -> None:
    """Register the ``export`` subcommand on the ``multihead`` command's subparsers."""
    p = sub.add_parser("export", help="export MultiHeadAttention (or the Transformer) to ONNX and verify it")
    p.add_argument("--model", choices=["mha", "transformer"], default="mha")
    p.add_argument("--embed-dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=2, help="example batch size (>= 2; the axis stays dynamic)")
    p.add_argument("--len", type=int, default=5, help="example query length (>= 2)")
    p.add_argument("--kv-len", type=int, default=7, help="example key/value length (>= 2)")
    p.add_argument("--no-valid-lens", action="store_true", help="no valid_lens input")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--opset", type=int, default=18)
    p.add_argument("--out", default="multihead.onnx")


def _example(args: argparse.Namespace) -> tuple[nn.Module, tuple[Tensor, ...], dict[str, Tensor]]:
    """The module and example inputs the ``export`` subcommand exports."""
    import multihead

    torch.manual_seed(args.seed)
    b, lq, lk, e = args.batch, args.len, args.kv_len, args.embed_dim
    lens = torch.arange(b) % lk + 1  # (B,): 1, 2, ... valid keys
    if args.model == "transformer":
        cls = getattr(multihead, "Transformer", None)
        if cls is None:
            raise SystemExit("multihead.Transformer is not available in this version; export --model mha")
        model = cls(50, 50, d_model=e, num_heads=args.heads, num_encoder_layers=2, num_decoder_layers=2,
                    d_ff=2 * e, dropout=0.0)  # fmt: skip
        src, tgt = torch.randint(1, 50, (b, lk)), torch.randint(1, 50, (b, lq))
        return model.eval(), (src, tgt), ({} if args.no_valid_lens else {"src_valid_lens": lens})
    mha = multihead.MultiHeadAttention(e, args.heads).eval()
    x, mem = torch.randn(b, lq, e), torch.randn(b, lk, e)
    return mha, (x, mem), ({} if args.no_valid_lens else {"valid_lens": lens})  # value = key


def run_cli(args: argparse.Namespace) -> int:
    """``multihead export``: write the ONNX file, verify it in onnxruntime, print what the graph takes."""
    module, inputs, kwargs = _example(args)
    print(f"exporting {type(module).__name__} -> {args.out} (opset {args.opset}) ...", flush=True)
    report = to_onnx(module, inputs, args.out, example_kwargs=kwargs, opset=args.opset)
    for name, shape in report.inputs.items():
        print(f"  input {name:<14} {shape}")
    tried = ", ".join("x".join(map(str, s)) for s in report.shapes)
    print(f"onnxruntime vs eager on {tried}: max |diff| = {report.max_error:.2e} (OK, <= 1e-5)")
    return 0
