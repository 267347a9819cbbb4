"""Induction heads of a real causal LM (SmolLM2-135M-Instruct, 30 layers x 9 heads), found with
``multihead.lens`` and confirmed by ablation and by patching: the worked example of docs/lens.md.

An induction head completes a repeat: at a token it has seen before, it attends to the token that came
after the earlier occurrence and copies it. On sequences of ``SEQ`` random tokens repeated twice
(``[bos] r r``), the model cannot predict the first half and can predict the second. Three measurements:

* scores (``lens.cache`` of every layer's pattern): a head's induction score is its mean attention from
  a token of the second half to the token after that token's first occurrence (the diagonal at offset
  ``SEQ - 1``); its previous-token score, its mean attention to the token just before;
* ablation (``lens.ablate``): the loss on the second half with the ``TOP`` heads of highest induction
  score zeroed (and mean-ablated over other repeated sequences), against ``TOP`` heads drawn at random
  among the rest, ``DRAWS`` times;
* patching (``lens.patch_heads``): clean ``[bos] r r``, corrupted ``[bos] r' r`` (the first half other
  random tokens, so the second half repeats nothing); each head's clean z patched into the corrupted run,
  metric the mean log-probability of the second half's next tokens, per example.

One thread::

    flock /tmp/bench.lock python benchmarks/lens_induction.py
    # writes benchmarks/results/lens_induction.{json,md} and docs/images/lens_induction.png
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from multihead import lens
from multihead.bench.pair import machine
from multihead.testing import smollm2_dir

ROOT = Path(__file__).resolve().parent
RESULTS, IMAGE = ROOT / "results", ROOT.parent / "docs" / "images" / "lens_induction.png"
SEQ, BATCH, PATCH_BATCH, TOP, DRAWS = 20, 8, 2, 6, 5
NAME = "model.layers.{}.self_attn"
TOKENS = (1000, 40000)  # random ids from here: ordinary sub-words, no special tokens


def repeated(seed: int, batch: int, bos: int, first: torch.Tensor | None = None) -> torch.Tensor:
    """(batch, 1 + 2 SEQ) token ids ``[bos] r r`` (or ``[bos] first r`` when ``first`` (batch, SEQ) is given)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(*TOKENS, (batch, SEQ), generator=g)  # (B, SEQ)
    start = torch.full((batch, 1), bos)
    return torch.cat([start, r if first is None else first, r], dim=1)  # (B, 1 + 2 SEQ)


def second_half_logprob(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(B,): mean log-probability of the second half's tokens 2..SEQ, each predicted from the one before
    (the first token of the second half cannot be predicted)."""
    pos = torch.arange(SEQ + 1, 2 * SEQ)  # predicting positions SEQ + 2 .. 2 SEQ
    logp = logits[:, pos].log_softmax(-1)  # (B, SEQ - 1, V)
    return logp.gather(-1, ids[:, pos + 1, None])[..., 0].mean(-1)


def scores(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(layers, H) induction and previous-token scores from every layer's pattern."""
    with torch.no_grad(), lens.cache(model, points=("pattern",)) as c:
        model(ids)
    pattern = c.stack("pattern")  # (layers, B, H, L, L)
    q = torch.arange(SEQ + 1, 2 * SEQ + 1)  # the second half's positions
    induction = pattern[..., q, q - SEQ + 1].mean(dim=(1, 3))  # (layers, H)
    previous = pattern[..., q, q - 1].mean(dim=(1, 3))
    return induction, previous


def loss(
    model: torch.nn.Module, ids: torch.Tensor, heads: list[tuple[int, int]], how: str, ref: dict
) -> float:
    """Mean loss (nats) on the second half with ``heads`` [(layer, head)] ablated (``how``)."""
    chosen: dict[str, list[int]] = {}
    for layer, head in heads:
        chosen.setdefault(NAME.format(layer), []).append(head)
    with torch.no_grad(), lens.ablate(model, chosen, how=how, reference=ref if how == "mean" else None):
        return float(-second_half_logprob(model(ids).logits, ids).mean())


def ablations(model: torch.nn.Module, ids: torch.Tensor, top: list, previous: tuple, bos: int) -> dict:
    """The loss with nothing, the top heads, the top previous-token head alone and random heads ablated,
    zero and mean ablation."""
    heads = model.config.num_attention_heads
    rest = [(i // heads, i % heads) for i in range(model.config.num_hidden_layers * heads)]
    rest = [h for h in rest if h not in top]
    g = torch.Generator().manual_seed(1)
    draws = [[rest[i] for i in torch.randperm(len(rest), generator=g)[:TOP].tolist()] for _ in range(DRAWS)]
    ref = {"input_ids": repeated(2, BATCH, bos)}  # other repeated sequences: the mean ablation's reference
    out: dict = {"none": loss(model, ids, [], "zero", ref), "random_heads": draws}
    for how in ("zero", "mean"):
        out[how] = {
            "top": loss(model, ids, top, how, ref),
            "previous": loss(model, ids, [previous], how, ref),
            "random": [loss(model, ids, d, how, ref) for d in draws],
        }
    return out


def patching(model: torch.nn.Module, bos: int) -> tuple[torch.Tensor, dict]:
    """(layers, H) effects of patching each head's clean z into the corrupted run, and the two baselines."""
    clean = repeated(3, PATCH_BATCH, bos)
    other = torch.randint(*TOKENS, (PATCH_BATCH, SEQ), generator=torch.Generator().manual_seed(4))
    corrupted = repeated(3, PATCH_BATCH, bos, first=other)

    def metric(out: object) -> torch.Tensor:
        return second_half_logprob(out.logits, clean)  # same targets: the second halves are equal

    with torch.no_grad():
        base = {
            k: float(metric(model(ids)).mean()) for k, ids in (("clean", clean), ("corrupted", corrupted))
        }
        effects = lens.patch_heads(model, {"input_ids": clean}, {"input_ids": corrupted}, metric)
    return torch.as_tensor(effects), base


def encoder() -> dict:
    """all-MiniLM-L6-v2 (BERT family, 6 layers x 12 heads) on 32 real sentences (the licence corpus of
    ``benchmarks/data/corpora.py``), padded: each head's mean attention to the previous and to the next token
    over the real tokens; and how far mean-pooled sentence embeddings move (1 - cosine) with the top
    previous-token head zeroed, against :data:`DRAWS` random heads."""
    import sys

    import transformers as T

    from multihead.integrations import transformers as mhtf
    from multihead.testing import minilm_dir

    mhtf.register()
    sys.path.insert(0, str(ROOT / "data"))
    import corpora  # real text the project did not write

    tok = T.AutoTokenizer.from_pretrained(minilm_dir())
    bert = T.AutoModel.from_pretrained(minilm_dir(), attn_implementation="multihead").eval()
    batch = tok(corpora.sentences(corpora.licence_texts())[:32], padding=True, return_tensors="pt")
    keep = batch["attention_mask"].clone()  # (B, L): real tokens, [CLS] and [SEP] excluded below
    keep[:, 0] = 0
    keep[torch.arange(len(keep)), keep.sum(1)] = 0  # [SEP]
    with torch.no_grad(), lens.cache(bert, points=("pattern",)) as c:
        base = bert(**batch).last_hidden_state
    pattern = c.stack("pattern")  # (6, B, 12, L, L)
    i = torch.arange(1, pattern.shape[-1] - 1)
    w = keep[:, i].float()  # (B, L - 2)
    diag = {"previous": pattern[..., i, i - 1], "next": pattern[..., i, i + 1]}  # (6, B, 12, L - 2)
    score = {k: (v * w[None, :, None]).sum(dim=(1, 3)) / w.sum() for k, v in diag.items()}  # (6, 12)
    heads = score["previous"].shape[1]
    top = divmod(int(score["previous"].argmax()), heads)
    g = torch.Generator().manual_seed(5)
    draws = [divmod(int(x), heads) for x in torch.randperm(score["previous"].numel(), generator=g)[:DRAWS]]

    def moved(layer: int, head: int) -> float:
        with torch.no_grad(), lens.ablate(bert, {f"encoder.layer.{layer}.attention.self": [head]}):
            out = bert(**batch).last_hidden_state
        m = batch["attention_mask"][..., None]  # (B, L, 1)
        pool = [(x * m).sum(1) / m.sum(1) for x in (base, out)]  # (B, E) each
        return float(1 - torch.cosine_similarity(*pool).mean())

    return {
        "sentences": len(keep),
        "previous": score["previous"].tolist(),
        "next": score["next"].tolist(),
        "top_previous": list(top),
        "moved_top": moved(*top),
        "random_heads": [list(d) for d in draws],
        "moved_random": [moved(*d) for d in draws],
    }


def figure(r: dict, path: Path) -> None:
    """Induction scores, previous-token scores and patching effects as layers x heads pictures, and the
    ablation losses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(15, 5.6), gridspec_kw={"width_ratios": [1, 1, 1, 1.3]})
    maps = (
        ("induction score", r["induction"], "viridis"),
        ("previous-token score", r["previous"], "viridis"),
        (
            "patching: clean z restores\nlog-prob of the repeat by",
            r["patching"]["effects_vs_corrupted"],
            "RdBu_r",
        ),
    )
    for ax, (title, values, cmap) in zip(axes, maps, strict=False):
        v = torch.tensor(values)
        span = float(v.abs().max()) if cmap == "RdBu_r" else None  # diverging: centred on 0
        im = ax.imshow(v, aspect="auto", cmap=cmap, vmin=-span if span else None, vmax=span)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        fig.colorbar(im, ax=ax, fraction=0.08)
    for layer, head in r["top"]:
        axes[0].add_patch(plt.Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, ec="red", lw=1.5))
    layer, head = r["previous_head"]
    axes[1].add_patch(plt.Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, ec="orange", lw=1.5))
    a, ax = r["ablation"], axes[3]
    prev = "L{}H{}".format(*r["previous_head"])
    rows = [("none", [a["none"]], "grey")]
    for how in ("zero", "mean"):
        rows += [
            (f"{how}: top {TOP}", [a[how]["top"]], "tab:red"),
            (f"{how}: {prev} alone", [a[how]["previous"]], "tab:orange"),
            (f"{how}: {TOP} random", a[how]["random"], "tab:blue"),
        ]
    for y, (_, xs, color) in enumerate(rows):
        ax.barh(y, sorted(xs)[len(xs) // 2], color=color)  # the median
        if len(xs) > 1:
            ax.plot(xs, [y] * len(xs), "k.", ms=6)  # each draw
    ax.set_yticks(range(len(rows)), [row[0] for row in rows])
    ax.invert_yaxis()
    ax.set_xlabel("loss on the repeated half (nats)")
    ax.set_title(f"heads ablated\n(random: median; dots: {DRAWS} draws)", fontsize=10)
    fig.suptitle(f"SmolLM2-135M-Instruct on {SEQ} random tokens repeated twice (red boxes: the top {TOP})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(r: dict) -> str:
    """The committed numbers: the top heads, the ablation losses, the patching's top heads."""
    a, p = r["ablation"], r["patching"]
    ind = torch.tensor(r["induction"])
    rows = [
        f"| L{layer}H{head} | {ind[layer, head]:.3f} | {r['previous'][layer][head]:.3f} |"
        for layer, head in r["top"]
    ]
    eff = torch.tensor(p["effects_vs_corrupted"])
    best = torch.topk(eff.flatten(), 10).indices.tolist()
    heads = eff.shape[1]
    patched = ", ".join(
        f"L{i // heads}H{i % heads} {eff.flatten()[i]:+.2f} (induction {ind.flatten()[i]:.2f}, previous "
        f"{torch.tensor(r['previous']).flatten()[i]:.2f})"
        for i in best
    )
    fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    return "\n".join(
        [
            "# Induction heads of SmolLM2-135M-Instruct (`benchmarks/lens_induction.py`)",
            "",
            f"{r['when']}, {r['cpu']}, {r['seconds']:.0f} s. {r['batch']} sequences of {SEQ} random tokens "
            f"repeated twice, after the BOS token.",
            "",
            f"| head (top {TOP} by induction score) | induction score | previous-token score |",
            "| --- | --- | --- |",
            *rows,
            "",
            f"Loss on the repeated half (nats): {a['none']:.2f} with every head; top {TOP} zeroed "
            f"{a['zero']['top']:.2f}, mean-ablated {a['mean']['top']:.2f}; {TOP} random other heads zeroed "
            f"{fmt(a['zero']['random'])}, mean-ablated {fmt(a['mean']['random'])} ({DRAWS} draws: "
            f"{'; '.join(' '.join(f'L{x}H{y}' for x, y in d) for d in a['random_heads'])}). The top previous-token "
            f"head L{r['previous_head'][0]}H{r['previous_head'][1]} (previous-token score "
            f"{r['previous'][r['previous_head'][0]][r['previous_head'][1]]:.3f}) alone: zeroed {a['zero']['previous']:.2f}, "
            f"mean-ablated {a['mean']['previous']:.2f}.",
            "",
            f"Patching ({p['batch']} pairs): mean log-probability of the repeat {p['clean']:.2f} clean, "
            f"{p['corrupted']:.2f} corrupted (first half other random tokens). The 10 heads whose clean z "
            f"restores it most: {patched}.",
            "",
            *_encoder_lines(r["encoder"]),
        ]
    )


def _encoder_lines(e: dict) -> list[str]:
    prev, nxt = torch.tensor(e["previous"]), torch.tensor(e["next"])
    heads = prev.shape[1]
    best = {k: divmod(int(v.argmax()), heads) for k, v in (("previous", prev), ("next", nxt))}
    above = {
        k: [f"L{a}H{b}" for a, b in (v > 0.5).nonzero().tolist()]
        for k, v in (("previous", prev), ("next", nxt))
    }
    return [
        f"all-MiniLM-L6-v2 on {e['sentences']} licence sentences: the most previous-token head "
        f"L{best['previous'][0]}H{best['previous'][1]} ({prev.max():.3f} of its attention on the token before), "
        f"the most next-token head L{best['next'][0]}H{best['next'][1]} ({nxt.max():.3f} on the token after); "
        f"heads above 0.5: previous {', '.join(above['previous'])}; next {', '.join(above['next'])}. Zeroing the "
        f"top previous-token head moves the mean-pooled sentence embeddings by {e['moved_top']:.4f} (1 - cosine); "
        f"{DRAWS} random heads: " + ", ".join(f"{x:.4f}" for x in e["moved_random"]) + ".",
        "",
    ]


def main() -> int:
    torch.set_num_threads(1)
    import transformers as T

    from multihead.integrations import transformers as mhtf

    mhtf.register()
    start = time.perf_counter()
    folder = smollm2_dir()
    model = T.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="multihead").eval()
    bos = T.AutoTokenizer.from_pretrained(folder).bos_token_id
    ids = repeated(0, BATCH, bos)
    induction, previous = scores(model, ids)
    heads = induction.shape[1]
    top = [(i // heads, i % heads) for i in torch.topk(induction.flatten(), TOP).indices.tolist()]
    prev = divmod(int(previous.argmax()), heads)
    ablation = ablations(model, ids, top, prev, bos)
    effects, base = patching(model, bos)
    bert = encoder()
    r = {
        "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": machine().words(),
        "batch": BATCH,
        "induction": induction.tolist(),
        "previous": previous.tolist(),
        "top": top,
        "previous_head": list(prev),
        "ablation": ablation,
        "patching": base
        | {"batch": PATCH_BATCH, "effects_vs_corrupted": (effects - base["corrupted"]).tolist()},
        "encoder": bert,
    }
    r["seconds"] = time.perf_counter() - start
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lens_induction.json").write_text(json.dumps(r, indent=1) + "\n")
    (RESULTS / "lens_induction.md").write_text(markdown(r))
    figure(r, IMAGE)
    print(markdown(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
