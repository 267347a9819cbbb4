"""Closed-form refit of each pruned layer's output projection (least squares, layer by layer).

Dimensions: n tokens, I = H' * Dv the projection's input (the kept heads, merged), O its output width.

After pruning, an attention layer's output projection sees only the kept heads: ``y' = W' x' + b``
where the original computed ``y = W x + b`` from every head. :func:`refit` chooses ``W'`` and ``b`` so
that the kept heads reproduce the original layer's output on the calibration tokens as well as a linear
map can (ordinary least squares with a small ridge, over the tokens of every text): the part of the
removed heads' output that the kept heads predict, and its mean (the bias), are put back (FLAP's bias
compensation and SliceGPT's/OBS-style layer-wise reconstruction do the same kind of thing).
:func:`refit_feed_forward` moves each feed-forward output projection so that the layer's residual sum
matches the original's, and :func:`refit_layers` (what the command runs) interleaves the two, layer by
layer. Layers are refit in the order they run, each on the inputs the already refit layers before it
give, so a later layer also corrects what earlier ones could not. Calibration tokens far outnumber the I + 1 unknowns
per output, so the fit generalises (see ``benchmarks/results/prune.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...heads.naming import attention_modules
from ...nn.attention import MultiHeadAttention
from .objectives import Batch, Objective
from .replay import Chain, _Stop, layer_of, run_stopped, stack_of

__all__ = [
    "FEED_FORWARD_RIDGE",
    "RIDGE",
    "LeastSquares",
    "Projection",
    "feed_forward_sums",
    "output_fits",
    "output_folds",
    "output_projection",
    "refit",
    "refit_feed_forward",
    "refit_layers",
]

RIDGE = 1e-2
"""Ridge of the fit, relative to the mean diagonal of X^T X (keeps it solvable with few tokens). On
all-MiniLM-L6-v2, 1e-2 gave the best validation quality of 1e-4, 1e-3, 1e-2 and 1e-1 on both real-text
corpora of ``benchmarks/bench_prune.py`` at ``--heads`` 0.5 and on package-docs at 0.25 (+0.001 to +0.004
over 1e-3; 1e-1 was worse wherever it was measured)."""


FEED_FORWARD_RIDGE = 0.3
"""Ridge of the feed-forward refit (:func:`refit_feed_forward`), relative to the mean diagonal of X^T X,
pulling the weights toward the original ones. On all-MiniLM-L6-v2 (seed 0, ``benchmarks/bench_prune.py``),
with the refit fit on the training texts plus two crops of each (:func:`refit_layers`), 0.3 gave a higher
validation Spearman than 1.0 on both real-text corpora at ``--heads`` 0.25 and 0.5 (+0.0015 to +0.0025),
and than 0.1 in two of the three cases measured; chosen per layer by 4-fold cross-validation of the token
residual it did worse than 1.0 (package-docs at 0.5, refit on the texts alone: 0.9285 against 0.9315)."""


class LeastSquares:
    """Accumulates the normal equations of ``y ~ W x + b`` over token rows and solves them.

    ``add(x (n, I), y (n, O))`` as often as needed (float64 sums), then ``solve()`` ->
    ``(W (O, I), b (O,))`` minimising ``sum ||W x + b - y||^2 + ridge * mean(diag(X^T X)) * ||W||^2``
    (``solve(bias=False)``: the same without ``b``, for a projection that has no bias).
    """

    def __init__(self, d_in: int, d_out: int) -> None:
        self.gram = torch.zeros(d_in + 1, d_in + 1, dtype=torch.float64)  # [X 1]^T [X 1]
        self.cross = torch.zeros(d_in + 1, d_out, dtype=torch.float64)  # [X 1]^T Y
        self.y_sum = torch.zeros(d_out, dtype=torch.float64)  # 1^T Y
        self.y_squares = 0.0  # ||Y||^2
        self.rows = 0

    def add(self, x: Tensor, y: Tensor) -> None:
        """Add rows ``x`` (n, I), ``y`` (n, O): their products in the inputs' precision (float32 at least),
        added to float64 sums (one call's n rows are few; the sums over every call are what needs the
        precision)."""
        dt = torch.promote_types(torch.promote_types(x.dtype, y.dtype), torch.float32)
        x1 = torch.cat([x.to(dt), torch.ones(len(x), 1, dtype=dt)], 1)  # (n, I + 1)
        y = y.to(dt)
        self.gram += (x1.T @ x1).double()
        self.cross += (x1.T @ y).double()
        self.y_sum += y.sum(0, dtype=torch.float64)
        self.y_squares += float(y.double().pow(2).sum())
        self.rows += len(x)

    def solution(self, columns: Tensor, ridge: float = RIDGE, *, bias: bool = True) -> Tensor:
        """The fit on input ``columns`` (a (k,) index tensor) only, and the intercept when ``bias``:
        (k (+1), O), the intercept last; the ridge as in :meth:`solve` (relative to the mean diagonal over
        every column)."""
        d = self.inputs
        idx = torch.cat([columns, torch.tensor([d])]) if bias else columns  # (k,)
        g = self.gram[idx][:, idx]  # (k, k)
        m = len(columns)
        g[range(m), range(m)] += ridge * self.gram.diagonal()[:d].mean().clamp_min(1e-12)  # bias not shrunk
        return torch.linalg.solve(g, self.cross[idx])

    def solve(self, ridge: float = RIDGE, *, bias: bool = True) -> tuple[Tensor, Tensor | None]:
        """``(W (O, I), b (O,))``; with ``bias=False`` the fit has no intercept and ``b`` is None."""
        d = self.inputs
        sol = self.solution(torch.arange(d), ridge, bias=bias)  # (k, O)
        return sol[:d].T, (sol[d] if bias else None)

    def residual(self, columns: Tensor, ridge: float = RIDGE, *, bias: bool = True) -> float:
        """``sum ||W x_c + b - y||^2`` over the rows added, for the fit (:meth:`solve`'s, ridge included)
        that sees only the input ``columns`` (a (k,) index tensor): what the best linear map of those
        columns leaves unexplained of the outputs."""
        return self.error(self.solution(columns, ridge, bias=bias), columns, bias=bias)

    def error(self, solution: Tensor, columns: Tensor, *, bias: bool = True) -> float:
        """``sum ||W x_c + b - y||^2`` over the rows added, for a given ``solution`` (k, O) on input
        ``columns`` (the intercept last when ``bias``), e.g. one fit on other rows
        (:class:`~multihead.commands.prune.choose.CrossValidated`)."""
        d = self.inputs
        idx = torch.cat([columns, torch.tensor([d])]) if bias else columns  # (k,)
        g, c = self.gram[idx][:, idx], self.cross[idx]  # (k, k), (k, O)
        return float(self.y_squares - 2 * (solution * c).sum() + (solution * (g @ solution)).sum())

    @property
    def inputs(self) -> int:
        """I, the input width of the map."""
        return len(self.gram) - 1

    def __add__(self, other: LeastSquares) -> LeastSquares:
        """The normal equations of both sets of rows."""
        return self._combined(other, 1)

    def __sub__(self, other: LeastSquares) -> LeastSquares:
        """The normal equations of these rows without ``other``'s (``other`` added to these before)."""
        return self._combined(other, -1)

    def _combined(self, other: LeastSquares, sign: int) -> LeastSquares:
        out = LeastSquares(self.inputs, self.cross.shape[1])
        out.gram, out.cross = self.gram + sign * other.gram, self.cross + sign * other.cross
        out.y_sum, out.y_squares = self.y_sum + sign * other.y_sum, self.y_squares + sign * other.y_squares
        out.rows = self.rows + sign * other.rows
        return out

    def spread(self) -> float:
        """``sum ||y - mean(y)||^2`` over the rows added: the outputs' energy about their mean."""
        return self.y_squares - float(self.y_sum @ self.y_sum) / max(self.rows, 1)


@dataclass
class Projection:
    """An attention module's output projection: the layer, and whether it stores its weight (in, out)."""

    layer: nn.Module
    transposed: bool = False  # transformers' Conv1D (GPT-2) keeps (in, out); nn.Linear keeps (out, in)

    @property
    def has_bias(self) -> bool:
        return getattr(self.layer, "bias", None) is not None

    def set(self, weight: Tensor, bias: Tensor | None) -> None:
        """Replace the weight (O, I) and the bias (O,), if the layer has one, in place (dtype kept)."""
        w = self.layer.weight
        with torch.no_grad():
            w.copy_((weight.T if self.transposed else weight).to(w.dtype))
            if bias is not None:
                self.layer.bias.copy_(bias.to(w.dtype))


def output_projection(model: nn.Module, name: str, module: nn.Module) -> Projection:
    """The output projection of attention module ``name`` (multihead's or a Hugging Face one)."""
    if isinstance(module, MultiHeadAttention):
        return Projection(module.out_proj)
    from ...integrations.transformers import ARCHITECTURES

    arch = ARCHITECTURES[type(module).__name__]
    path = f"{name.rpartition('.')[0]}.{arch.o[3:]}" if arch.o.startswith("../") else f"{name}.{arch.o}"
    return Projection(model.get_submodule(path.lstrip(".")), arch.conv1d)


def _real(t: Tensor, mask: Tensor) -> Tensor:
    """(B, L) bool: which rows of ``t`` (B, L, C) are real tokens: ``mask`` (B, L) where it fits ``t``'s
    shape, else every row."""
    return mask.bool() if t.shape[:2] == mask.shape else torch.ones(t.shape[:2], dtype=torch.bool)


def _rows(t: Tensor, mask: Tensor) -> Tensor:
    """The real tokens' rows of ``t`` (B, L, C) -> (n, C) (:func:`_real`)."""
    return t[_real(t, mask)]


class _Step:
    """One projection refit in the sequence (:func:`_refit_in_order`): where the teacher's target is recorded,
    what the student's pass captures, and how the fit changes the student."""

    def __init__(self, ridge: float) -> None:
        self.ridge = ridge
        self.targets: list[Tensor] = []  # the teacher's target rows, one tensor per batch

    def teacher_hook(self, current: dict[str, Tensor]) -> Any:
        """A hook on the teacher that records this step's target rows per batch (a removable handle)."""
        raise NotImplementedError

    def capture(self) -> list[nn.Module]:
        """The student's layers whose first inputs the fit needs, in the order they run."""
        raise NotImplementedError

    def rows(self, seen: list[Tensor], target: Tensor) -> tuple[Tensor, Tensor]:
        """``(x (n, I), y (n, O))`` of the fit from what the student's pass saw and the teacher's target."""
        raise NotImplementedError

    def apply(self, fit: LeastSquares) -> None:
        """Change the student's projection by the solved fit."""
        raise NotImplementedError


class _OutputStep(_Step):
    """An attention layer's output projection: the kept heads' merged contexts -> the teacher's output."""

    def __init__(self, student: Projection, teacher: nn.Module, ridge: float) -> None:
        super().__init__(ridge)
        self.student, self.teacher = student, teacher

    def teacher_hook(self, current: dict[str, Tensor]) -> Any:
        return self.teacher.register_forward_hook(_recorder(self.targets, current))

    def capture(self) -> list[nn.Module]:
        return [self.student.layer]

    def rows(self, seen: list[Tensor], target: Tensor) -> tuple[Tensor, Tensor]:
        return seen[0], target

    def apply(self, fit: LeastSquares) -> None:
        self.student.set(*fit.solve(self.ridge, bias=self.student.has_bias))  # no bias: it keeps none


class _FeedForwardStep(_Step):
    """A feed-forward output projection, moved so that its residual sum (the LayerNorm's input) matches the
    teacher's: the fit of ``x -> t - s``, pulled toward no change by the ridge."""

    def __init__(self, student: tuple[nn.Module, nn.Module], teacher_norm: nn.Module, ridge: float) -> None:
        super().__init__(ridge)
        (self.proj, self.norm), self.teacher_norm = student, teacher_norm

    def teacher_hook(self, current: dict[str, Tensor]) -> Any:
        return self.teacher_norm.register_forward_pre_hook(_recorder(self.targets, current))

    def capture(self) -> list[nn.Module]:
        return [self.proj, self.norm]

    def rows(self, seen: list[Tensor], target: Tensor) -> tuple[Tensor, Tensor]:
        x, s = seen  # (n, F), (n, E)
        return x, target - s

    def apply(self, fit: LeastSquares) -> None:
        dw, db = fit.solve(self.ridge)
        Projection(self.proj).set(self.proj.weight.double() + dw, self.proj.bias.double() + db)


def _refit_in_order(
    student: nn.Module,
    teacher: nn.Module,
    batches: Sequence[Batch],
    objective: Objective,
    steps: Sequence[tuple[str, _Step]],
    progress: Callable[[], None] | None,
) -> int:
    """Run ``steps`` (``(attention module, step)``, in the order the model runs their layers) on the real
    tokens of ``batches``: each step's fit sees the student's inputs as the steps before it left them.

    Where the layers chain, through a :class:`~.replay.Chain` of each model over the layers from the first
    step's to the last's: at each layer the teacher's layer runs once per batch (recording that layer's
    targets), then per step the student's layer once per batch (its inputs for the fit), then once more to
    give the next layer's input. Elsewhere one pass of the teacher records every target and a pass of the
    student stopped at each step's last layer gives its inputs. Returns ``len(steps)``."""
    chains = _chains(student, teacher, batches, objective, [name for name, _ in steps]) if steps else None
    if chains is None:
        current: dict[str, Any] = {}
        _run_hooked(teacher, batches, objective, current, [step.teacher_hook(current) for _, step in steps])
        for _, step in steps:
            _fit_step(
                step, [_capture_inputs(student, step.capture(), objective, b) for b in batches], progress
            )
        return len(steps)
    t_chain, s_chain = chains
    layers = [layer_of(student, name) for name, _ in steps]
    current = {}

    def masked(b: int) -> None:
        current["mask"] = batches[b].inputs["attention_mask"]

    for name in s_chain.names:
        here = [step for (_, step), layer in zip(steps, layers, strict=True) if layer == name]
        handles = [step.teacher_hook(current) for step in here]
        try:
            t_chain.advance(before=masked)
        finally:
            for h in handles:
                h.remove()
        for step in here:
            _fit_step(step, [_capture_in(s_chain, b, step.capture(), batches[b]) for b in range(len(batches))],
                      progress)  # fmt: skip
        s_chain.advance()
    return len(steps)


def _chains(
    student: nn.Module, teacher: nn.Module, batches: Sequence[Batch], objective: Objective, modules: list[str]
) -> tuple[Chain, Chain] | None:
    """A :class:`~.replay.Chain` of the teacher and of the student over the layers from the one holding the
    first of ``modules`` (attention modules) to the one holding the last; None where they do not chain."""
    layers = [layer_of(student, name) for name in modules]
    stack = None if None in layers else stack_of(student, layers)  # type: ignore[arg-type]
    if stack is None:
        return None
    names = stack[min(map(stack.index, layers)) : max(map(stack.index, layers)) + 1]
    t_chain, s_chain = (Chain.record(m, names, batches, objective) for m in (teacher, student))
    return None if t_chain is None or s_chain is None else (t_chain, s_chain)


def _fit_step(step: _Step, seen: Sequence[list[Tensor]], progress: Callable[[], None] | None) -> None:
    """Solve ``step``'s fit from the student's captured inputs ``seen`` (one list per batch) and its
    targets, and apply it."""
    fit: LeastSquares | None = None
    for inputs, target in zip(seen, step.targets, strict=True):
        x, y = step.rows(inputs, target)
        fit = fit or LeastSquares(x.shape[1], y.shape[1])
        fit.add(x, y)
    assert fit is not None
    step.apply(fit)
    step.targets.clear()
    if progress is not None:
        progress()


def _capture_in(chain: Chain, b: int, modules: Sequence[nn.Module], batch: Batch) -> list[Tensor]:
    """The real tokens' rows of each of ``modules``' first input when ``chain``'s current layer runs batch
    ``b`` (modules inside that layer, in the order they run: the run stops at the last)."""
    seen, handles = _recording(modules, batch)
    try:
        chain.run(b)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    return [s[0] for s in seen]


def _recording(modules: Sequence[nn.Module], batch: Batch) -> tuple[list[list[Tensor]], list[Any]]:
    """Hooks that record the real tokens' rows of each of ``modules``' first input on ``batch`` and stop the
    pass (:class:`_Stop`) at the last of them: ``(what each saw, the hooks' handles)``."""
    seen: list[list[Tensor]] = [[] for _ in modules]
    current = {"mask": batch.inputs["attention_mask"]}
    handles = [m.register_forward_pre_hook(_recorder(seen[i], current)) for i, m in enumerate(modules)]

    def stop(*_: object) -> None:
        raise _Stop

    return seen, [*handles, modules[-1].register_forward_pre_hook(stop)]


def _output_steps(
    student: nn.Module, teacher: nn.Module, modules: Sequence[str], ridge: float
) -> dict[str, _Step]:
    s_mods, t_mods = attention_modules(student), attention_modules(teacher)
    return {n: _OutputStep(output_projection(student, n, s_mods[n]), output_projection(teacher, n, t_mods[n]).layer,
                           ridge) for n in s_mods if n in set(modules)}  # fmt: skip


def _feed_forward_steps(student: nn.Module, teacher: nn.Module, ridge: float) -> dict[str, _Step]:
    """``{attention module: step}`` of each layer's feed-forward refit; empty when the models have no
    :func:`feed_forward_sums` structure or their layers do not pair up."""
    s, t = _feed_forward_by_module(student), _feed_forward_by_module(teacher)
    if not s or list(s) != list(t):
        return {}
    return {name: _FeedForwardStep(s[name], t[name][1], ridge) for name in s}


def refit(
    student: nn.Module,
    teacher: nn.Module,
    batches: Sequence[Batch],
    objective: Objective,
    modules: Sequence[str],
    *,
    ridge: float = RIDGE,
    progress: Callable[[], None] | None = None,
) -> None:
    """Refit the output projections of ``modules`` of ``student`` (pruned) to ``teacher``'s outputs, in place.

    ``modules`` are names of :func:`multihead.heads.attention_modules`, the same in both models. One pass
    of the teacher records each projection's output on the real tokens of ``batches``; then for each
    module in the order the model runs them, a pass of the student (stopped at that module) gives the
    kept heads' output, and :class:`LeastSquares` gives the new weight and bias.
    """
    steps = list(_output_steps(student, teacher, modules, ridge).items())
    _refit_in_order(student, teacher, batches, objective, steps, progress)


def feed_forward_sums(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """``(projection, norm)`` of each layer of a post-LayerNorm encoder (BERT's family: a layer holding
    ``attention`` and ``output.dense`` / ``output.LayerNorm``), in the order the layers run: the
    feed-forward output projection, and the LayerNorm whose input is that projection's output plus the
    residual. Empty for a model without that structure (the feed-forward refit then does nothing)."""
    return list(_feed_forward_by_module(model).values())


def _feed_forward_by_module(model: nn.Module) -> dict[str, tuple[nn.Module, nn.Module]]:
    """:func:`feed_forward_sums`, keyed by the layer's attention module."""
    found = {}
    for name in attention_modules(model):
        layer_name, sep, _ = name.rpartition(".attention")
        out = getattr(model.get_submodule(layer_name), "output", None) if sep else None
        proj, norm = getattr(out, "dense", None), getattr(out, "LayerNorm", None)
        if isinstance(proj, nn.Linear) and isinstance(norm, nn.LayerNorm) and proj.bias is not None:
            found[name] = (proj, norm)
    return found


def refit_feed_forward(
    student: nn.Module,
    teacher: nn.Module,
    batches: Sequence[Batch],
    objective: Objective,
    *,
    ridge: float = FEED_FORWARD_RIDGE,
    progress: Callable[[], None] | None = None,
) -> int:
    """Refit each layer's feed-forward output projection of ``student`` so that its residual sum matches
    ``teacher``'s, in place; returns the number of projections refit (0 when :func:`feed_forward_sums`
    finds none, or the two models' layers do not pair up).

    Layer after layer, on the real tokens of ``batches``: with ``x`` (n, F) the student's projection input,
    ``s`` (n, E) the student's sum going into the LayerNorm (projection output + residual) and ``t`` (n, E)
    the teacher's, the projection's weight and bias move by the ridge fit of ``x -> t - s``: the closest
    change, pulled toward none by ``ridge``, that makes up for what pruning (and every earlier layer)
    changed in this layer's sum. Later layers are fit on the inputs the refit earlier ones give.
    """
    steps = list(_feed_forward_steps(student, teacher, ridge).items())
    return _refit_in_order(student, teacher, batches, objective, steps, progress)


def refit_layers(
    student: nn.Module,
    teacher: nn.Module,
    batches: Sequence[Batch],
    objective: Objective,
    modules: Sequence[str] | None = None,
    *,
    ridge: float = RIDGE,
    feed_forward_ridge: float = FEED_FORWARD_RIDGE,
    progress: Callable[[], None] | None = None,
) -> int:
    """:func:`refit` and :func:`refit_feed_forward` interleaved, layer by layer, in place: each pruned
    layer's attention output projection, then that layer's feed-forward output projection (where the
    model has one), then the next layer's, each fit on the inputs the refits before it give. ``modules``:
    the attention modules whose output projections are refit (None: every one). Returns the number of
    projections refit.

    Interleaved, a layer's attention refit already sees the feed-forward corrections of every earlier
    layer (run one after the other, :func:`refit` sees none of them). On all-MiniLM-L6-v2 (seed 0,
    ``benchmarks/bench_prune.py``'s external held-out Spearman) it gave +0.0002 to +0.0026 over the two
    passes one after the other on both real-text corpora at ``--heads`` 0.25 and 0.5.
    """
    attention = _output_steps(
        student, teacher, list(attention_modules(student)) if modules is None else modules, ridge
    )
    feed = _feed_forward_steps(student, teacher, feed_forward_ridge)
    steps = [
        (name, step)
        for name in attention_modules(student)
        for step in (attention.get(name), feed.get(name))
        if step
    ]
    return _refit_in_order(student, teacher, batches, objective, steps, progress)


def output_fits(
    model: nn.Module, batches: Sequence[Batch], objective: Objective, modules: Sequence[str] | None = None
) -> dict[str, LeastSquares]:
    """The normal equations of each output projection's own map, input (n, I) -> output (n, O), over the
    real tokens of ``batches`` (one pass of ``model``): ``{module: LeastSquares}`` for ``modules`` (default:
    every attention module)."""
    return {name: parts[0] for name, parts in output_folds(model, batches, objective, 1, modules).items()}


def output_folds(
    model: nn.Module,
    batches: Sequence[Batch],
    objective: Objective,
    folds: int,
    modules: Sequence[str] | None = None,
) -> dict[str, list[LeastSquares]]:
    """:func:`output_fits`, the texts dealt into ``folds`` folds in turn (text ``i`` of the pass, counted over
    ``batches``, into fold ``i % folds``): ``{module: [LeastSquares of fold f]}``. What
    :class:`~multihead.commands.prune.choose.CrossValidated` measures the refit's error on unseen texts
    with."""
    mods = attention_modules(model)
    fits: dict[str, list[LeastSquares]] = {}
    current: dict[str, Any] = {}

    def adder(name: str) -> Callable[..., None]:
        def hook(layer: nn.Module, args: tuple, output: Tensor) -> None:
            x, y = args[0].detach(), output.detach()
            real = _real(x, current["mask"])  # (B, L)
            fold = (current["first"] + torch.arange(len(real))) % folds  # (B,) each text's fold
            if name not in fits:
                fits[name] = [LeastSquares(x.shape[-1], y.shape[-1]) for _ in range(folds)]
            parts = fits[name]
            for f, part in enumerate(parts):
                rows = real & (fold == f)[:, None]  # (B, L)
                if rows.any():
                    part.add(x[rows], y[rows])

        return hook

    names = list(mods) if modules is None else list(modules)
    hooks = [output_projection(model, n, mods[n]).layer.register_forward_hook(adder(n)) for n in names]
    _run_hooked(model, batches, objective, current, hooks)
    return fits


def _run_hooked(
    model: nn.Module, batches: Sequence[Batch], objective: Objective, current: dict[str, Any], hooks: list
) -> None:
    """One no-grad pass of ``model`` over ``batches`` with ``current["mask"]`` set to each batch's attention
    mask for the ``hooks`` to read; the hooks are removed afterwards, also on an error."""
    with torch.no_grad():
        try:
            current["first"] = 0  # the index of the batch's first text in the pass
            for b in batches:
                current["mask"] = b.inputs["attention_mask"]
                objective.forward(model, b)
                current["first"] += len(b.inputs["attention_mask"])
        finally:
            for h in hooks:
                h.remove()


def _recorder(store: list[Tensor], current: dict[str, Tensor]) -> Callable[..., None]:
    """A hook that appends the real tokens' rows of what it sees to ``store``: the output of a forward
    hook, the first input of a forward pre-hook."""

    def hook(layer: nn.Module, args: tuple, output: Tensor | None = None) -> None:
        store.append(_rows((args[0] if output is None else output).detach(), current["mask"]))

    return hook


def _capture_inputs(
    model: nn.Module, layers: Sequence[nn.Module], objective: Objective, batch: Batch
) -> list[Tensor]:
    """The real tokens' rows of each of ``layers``' first input when ``model`` runs ``batch``; the pass
    stops at the last of them (``layers`` in the order they run)."""
    seen, handles = _recording(layers, batch)
    run_stopped(model, objective, batch, handles)
    return [s[0] for s in seen]
