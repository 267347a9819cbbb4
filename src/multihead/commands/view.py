"""``multihead view MODEL_DIR --text TEXT --out page.html``: every head of a checkpoint on one offline page.

Dimensions: B batch (1 here), H heads, L tokens (Ls encoder, Lt decoder), Lq/Lk query/key lengths.

Loads the folder on multihead attention (:mod:`.model_dir`), runs the text through it inside
``viz.capture`` (encoder self, decoder self and cross attention of an encoder-decoder), optionally scores
the heads with ``heads.importance``, and writes the page of :mod:`multihead.viz.page` (and, with
``--png``, a matplotlib figure of the model view).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .model_dir import BadInput, CheckpointFolder, load, quiet_tokenizer

if TYPE_CHECKING:  # imported where used: building the CLI's parser stays light
    import torch

    from ..viz.page import EncodedModule

__all__ = [
    "Inputs",
    "add_cli",
    "capture_modules",
    "importance_scores",
    "prepare_inputs",
    "readable",
    "run",
    "view_page",
]

EXAMPLES = """\
examples:
  multihead view ./all-MiniLM-L6-v2 --text "The cat sat on the mat." --out heads.html
  multihead view ./bert --text "Who wrote it?" --text-pair "Tolstoy wrote it." --out qa.html --importance
  multihead view ./bart --text "source sentence" --text-pair "target sentence" --out bart.html --png bart.png

MODEL_DIR is a folder written by save_pretrained (config.json, weights, tokenizer); nothing is downloaded.
For an encoder-decoder, --text goes to the encoder and --text-pair (default: --text) is the decoder's
target, fed shifted right. The page needs no network: open it from disk in any browser."""


def add_cli(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``view`` subcommand on the ``multihead`` command's subparsers (handler: :func:`run`)."""
    p = sub.add_parser(
        "view",
        help="an offline HTML page of every attention head of a Hugging Face checkpoint folder",
        description="Run a text through a local transformers checkpoint on multihead attention and write one "
        "self-contained HTML page: a thumbnail of every layer x head, token-to-token lines of the heads you "
        "pick, and a sortable table of per-head statistics (and importance with --importance).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model_dir", metavar="MODEL_DIR", help="a checkpoint folder (config.json, weights, tokenizer)"
    )
    p.add_argument("--text", required=True, help="the text to run through the model")
    p.add_argument(
        "--text-pair", metavar="TEXT2", help="a second segment (encoder-decoder: the decoder's text)"
    )
    p.add_argument("--out", required=True, metavar="PAGE.html", help="the HTML page to write")
    p.add_argument(
        "--png", metavar="FIGURE.png", help="also a static figure of the model view (multihead[viz])"
    )
    p.add_argument(
        "--importance", action="store_true", help="score each head (gradient importance on the text)"
    )
    p.add_argument("--truncate", action="store_true", help="cut a text longer than the model takes")
    return p


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Inputs:
    """What the model is called with and how to label it.

    ``kwargs`` go to ``model(**kwargs)``; ``sequences``/``special`` label the tokens (``{"input": ...}``,
    or ``{"encoder": ..., "decoder": ...}``); ``labels`` (1, Lt) are an encoder-decoder's targets.
    """

    kwargs: dict[str, torch.Tensor]
    sequences: dict[str, list[str]]
    special: dict[str, list[bool]]
    labels: torch.Tensor | None = None


def _tokenize(ckpt: CheckpointFolder, text: str, pair: str | None, *, truncate: bool, what: str) -> Any:
    tok, limit = ckpt.tokenizer, ckpt.max_length
    with quiet_tokenizer():
        enc = tok(text, pair, return_tensors="pt", truncation=bool(truncate and limit), max_length=limit)
    n = enc["input_ids"].shape[1]
    if limit is not None and n > limit:
        raise BadInput(
            f"{what} is {n} tokens, more than the {limit} the model takes; shorten it or pass --truncate"
        )
    if n == 0:
        raise BadInput(f"{what} gives no tokens; pass some text")
    return enc


_CONTROLS = str.maketrans({"\n": "\u21b5", "\r": "\u21b5", "\t": "\u21e5"})  # shown as arrows


def readable(tokenizer: Any, token: str) -> str:
    """A token as the page labels it: as the tokenizer writes it in text (a byte-level BPE's ``"Ġcan"``
    -> ``" can"``, ``"Ċ"`` -> a return arrow, a lone space -> ``"␣"``), or as it is where that text is not
    whole characters (a piece of a multi-byte character) or empty."""
    text = tokenizer.convert_tokens_to_string([token])
    if not text or "\ufffd" in text:
        return token
    text = text.translate(_CONTROLS)
    return text if text.strip() else "\u2423" * len(text)


def _labels(ckpt: CheckpointFolder, ids: torch.Tensor) -> tuple[list[str], list[bool]]:
    tok, special = ckpt.tokenizer, set(ckpt.tokenizer.all_special_ids)
    row = ids[0].tolist()
    return [readable(tok, str(t)) for t in tok.convert_ids_to_tokens(row)], [i in special for i in row]


def prepare_inputs(
    ckpt: CheckpointFolder, text: str, text_pair: str | None = None, *, truncate: bool = False
) -> Inputs:
    """Tokenize for the checkpoint's kind; raise :class:`BadInput` for a text longer than the model takes.

    An encoder-decoder gets ``text`` in the encoder and ``text_pair`` (default ``text``) as its target:
    the decoder reads ``[decoder_start] + target[:-1]``, the target shifted right, as in training.
    """
    if ckpt.kind != "encoder-decoder":
        enc = _tokenize(
            ckpt, text, text_pair, truncate=truncate, what="--text" + (" + --text-pair" * bool(text_pair))
        )
        tokens, special = _labels(ckpt, enc["input_ids"])
        kwargs = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        return Inputs(kwargs, {"input": tokens}, {"input": special})
    src = _tokenize(ckpt, text, None, truncate=truncate, what="--text")
    tgt = _tokenize(
        ckpt, text if text_pair is None else text_pair, None, truncate=truncate, what="--text-pair"
    )
    import torch

    start = ckpt.config.decoder_start_token_id
    if start is None:
        start = ckpt.config.pad_token_id or 0
    labels = tgt["input_ids"]  # (1, Lt)
    dec = torch.cat([torch.tensor([[start]]), labels[:, :-1]], dim=1)  # (1, Lt): shifted right
    s_tok, s_spec = _labels(ckpt, src["input_ids"])
    d_tok, d_spec = _labels(ckpt, dec)
    kwargs = {
        "input_ids": src["input_ids"],
        "attention_mask": src["attention_mask"],
        "decoder_input_ids": dec,
    }
    return Inputs(
        kwargs, {"encoder": s_tok, "decoder": d_tok}, {"encoder": s_spec, "decoder": d_spec}, labels
    )


# ------------------------------------------------------------------------------------------------
# Capture and importance
# ------------------------------------------------------------------------------------------------


def capture_modules(ckpt: CheckpointFolder, inputs: Inputs) -> list[EncodedModule]:
    """Run the model once inside ``viz.stream``: each module's weights (H, Lq, Lk) are encoded for the page
    as soon as the module has run and then dropped, so only one module's float weights are ever held
    (:func:`~multihead.viz.inline.encode_run`, which the notebook's head view runs too). One
    :class:`EncodedModule` per module, in run order."""
    from ..viz.inline import encode_run

    return encode_run(ckpt.model, inputs.kwargs, special=inputs.special)


def _loss(ckpt: CheckpointFolder, inputs: Inputs) -> Any:
    """A label-free objective for the text: what the model is trained to predict, or its embedding's norm."""
    kind = ckpt.kind

    def loss_fn(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if kind == "encoder-decoder":
            return model(**batch, labels=inputs.labels).loss  # the target given the source
        if kind in ("causal-lm", "masked-lm"):
            return model(**batch, labels=batch["input_ids"]).loss  # next token / the (unmasked) tokens back
        hidden = model(**batch).last_hidden_state  # (1, L, E): a bare encoder or decoder
        return hidden.mean(dim=1).norm()  # the mean-pooled embedding's norm (sentence-transformers pool so)

    return loss_fn


@contextmanager
def _frozen(model: Any) -> Iterator[None]:
    """Within the block no parameter of ``model`` requires grad; each one's flag is restored after."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def importance_scores(ckpt: CheckpointFolder, inputs: Inputs) -> dict[str, list[float]]:
    """``heads.importance`` on the one text with :func:`_loss`'s objective: ``{module: H scores}``.

    The parameters are frozen meanwhile: importance differentiates the loss by the head gates only, so
    the scores are the same, but the forward then keeps no layer input for a weight gradient (about
    0.4 GB less at 1,000 tokens on a 30-layer model) and builds a smaller graph.
    """
    from .. import heads

    if ckpt.kind == "causal-lm" and inputs.kwargs["input_ids"].shape[1] < 2:
        raise BadInput("--importance on a causal language model needs a text of at least 2 tokens")
    with _frozen(ckpt.model):
        scores = heads.importance(ckpt.model, [inputs.kwargs], _loss(ckpt, inputs))
    return {name: s.tolist() for name, s in scores.items()}


# ------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------


def view_page(
    ckpt: CheckpointFolder,
    text: str,
    text_pair: str | None = None,
    *,
    truncate: bool = False,
    importance: bool = False,
) -> tuple[str, list[EncodedModule]]:
    """The HTML page for ``text`` on a loaded checkpoint, and the modules (encoded weights, statistics,
    importance) on it."""
    from ..viz.page import build_page

    inputs = prepare_inputs(ckpt, text, text_pair, truncate=truncate)
    modules = capture_modules(ckpt, inputs)
    if importance:
        scores = importance_scores(ckpt, inputs)
        modules = [replace(m, importance=scores.get(m.name)) for m in modules]
    lengths = ", ".join(f"{len(v)} {k} tokens" for k, v in inputs.sequences.items())
    facts = {
        "folder": str(ckpt.path),
        "model": f"{type(ckpt.model).__name__} ({ckpt.kind})",
        "heads": f"{len(modules)} modules, {sum(m.heads for m in modules)} heads",
        "text": lengths,
    }
    page = build_page(
        modules, inputs.sequences, inputs.special, title=f"multihead view: {ckpt.path.name}", facts=facts
    )
    return page, modules


def model_view_figure(modules: list[EncodedModule], *, title: str) -> Any:
    """A matplotlib figure of the page's model view: one heatmap (Lq x Lk, square-root scale) per module
    (rows) and head (columns); modules may differ in heads and lengths (an encoder-decoder's three kinds)."""
    from ..viz import new_figure
    from ..viz.show import short_name

    cols = max(m.heads for m in modules)
    cell = 1.0 if cols <= 16 else 0.6
    fig = new_figure(figsize=(1.6 + cell * cols, 0.5 + cell * len(modules)), layout="constrained")
    fig.suptitle(title)
    axes = fig.subplots(len(modules), cols, squeeze=False)
    for r, m in enumerate(modules):
        for h in range(cols):
            ax = axes[r][h]
            ax.set_xticks([])
            ax.set_yticks([])
            if h < m.heads:
                w = m.head(h).sqrt()  # (Lq, Lk), decoded; as on the page: a uniform head stays pale
                ax.imshow(
                    w.numpy(), cmap="Blues", vmin=0, vmax=max(float(w.max()), 0.5), interpolation="nearest"
                )
            else:
                ax.set_axis_off()
            if r == 0:
                ax.set_title(f"head {h}", fontsize=8)
        axes[r][0].set_ylabel(short_name(m.name), fontsize=8, rotation=0, ha="right", va="center")
    return fig


def _check_out(path: str, option: str, suffixes: tuple[str, ...]) -> Path:
    out = Path(path)
    if out.is_dir():
        raise BadInput(
            f"{option} {path} is a directory; name the file to write, e.g. {Path(path) / 'heads'}{suffixes[0]}"
        )
    if not out.parent.is_dir():
        raise BadInput(f"{option} {path}: no such directory {out.parent}; create it first")
    return out


def run(args: argparse.Namespace) -> int:
    """The ``view`` command: check every argument, load, capture, write the page (and the PNG)."""
    out = _check_out(args.out, "--out", (".html",))
    png = None if args.png is None else _check_out(args.png, "--png", (".png",))
    if not args.text.strip():
        raise BadInput("--text is empty; pass the text to run through the model")
    if png is not None:
        from .._extras import require

        require("viz", ("matplotlib.figure",), "multihead view --png")
    ckpt = load(args.model_dir)
    page, modules = view_page(
        ckpt, args.text, args.text_pair, truncate=args.truncate, importance=args.importance
    )
    if png is not None:
        model_view_figure(modules, title=f"{ckpt.path.name}: every head").savefig(
            png, dpi=100, metadata={"Software": None}
        )
    out.write_text(page, encoding="utf-8")
    n = sum(m.heads for m in modules)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.2f} MiB, {n} heads)" + (f" and {png}" if png else ""))
    return 0
