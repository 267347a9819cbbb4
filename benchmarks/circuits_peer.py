"""TransformerLens 4.3's side of ``benchmarks/bench_circuits.py``: its gradients, node and edge attribution
patching and faithfulness (``transformer_lens.tools.analysis.attribution_patching``), read in multihead's
layout and node names; and the data both tools run on.

TransformerLens's semantics, as its source has them (read there, not guessed):

* ``cache_activation_and_gradient(bridge, tokens, metric_fn, names_filter)``: one forward with forward hooks,
  then ``torch.autograd.grad(metric, live activations)`` drives the backward; its backward hooks keep the
  gradient each hook receives. ``metric_fn(logits)`` must return a scalar, so a batch's gradient is that of
  the per-example metric summed (here) or averaged.
* ``attribution_patch(bridge, clean, corrupt, metric_fn, EdgeAttributionConfig(granularity))``: a loop over
  the pairs, one at a time (a clean forward, a corrupted forward and backward each); a node's score is
  ``(a_clean - a_corrupt) . g`` at its hook, per position (``attn.hook_z`` for a head), averaged over the
  pairs. ``metric_fn`` sees one pair's logits and nothing else, so a metric that reads each pair's own answer
  tokens (the IOI-style pairs below) cannot be written for a batch: :func:`node_scores` and
  :func:`edge_scores` call it once per pair with that pair's metric and average, the same work its own loop
  does. Edges are per position (a writer at p feeds the readers at p): writers ``hook_embed``,
  ``attn.hook_result`` per head, ``hook_mlp_out``; readers ``attn.hook_{q,k,v}_input`` per *query* head,
  ``hook_mlp_in`` and the final ``hook_resid_post`` (the logits); GQA/MQA models, post-norm and parallel
  blocks are refused (``_check_kv_heads_match_query_heads`` and its neighbours). ``ig_steps > 1`` raises
  ``NotImplementedError``.
* ``faithfulness(bridge, clean, corrupt, metric_fn, circuit)``: one pair; the clean run with every edge
  outside ``circuit`` rebuilt at its reader's hook with the writer's corrupted contribution (exact), as a
  fraction of the clean - corrupted gap.

multihead's edges are summed over positions and its k/v readers are key/value heads (the same as query heads
on a non-GQA model): :func:`edge_scores` sums TransformerLens's per-position scores into multihead's
:class:`multihead.lens.Node` pairs, and :func:`tl_circuit` spreads multihead's edges over every position.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

import torch
from lens_peer import boot, hook_name, to_multihead  # noqa: F401  (boot: re-exported for the benchmark)

from multihead.lens import Node

TEMPLATES = (
    "When{a} and{b} went to the store,{s} gave a drink to",
    "When{a} and{b} went to the park,{s} gave a ball to",
    "After{a} and{b} went to the market,{s} handed a book to",
    "When{a} and{b} got to the party,{s} gave a gift to",
)
"""IOI-style templates: the clean prompt repeats the second name as the subject ({s} = {b}), so the answer
is the first; the corrupted prompt repeats the first ({s} = {a}), so the answer flips."""
NAMES = (
    " Mary", " John", " Sarah", " Tom", " Anna", " James", " Lisa", " Paul",
    " Kate", " Mark", " Emma", " David", " Alice", " Peter", " Susan", " Jack",
)  # fmt: skip
"""Names that are one token each in SmolLM2's tokenizer (checked by :func:`ioi_pairs`)."""

ATTN, MLP, EMBED, UNEMBED = (
    "model.layers.{}.self_attn",
    "model.layers.{}.mlp",
    "model.embed_tokens",
    "lm_head",
)
"""Module names of a Hugging Face Llama (``named_modules()``), as multihead's nodes carry them."""

RANDOM_LLAMA = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=256,
    initializer_range=0.1,  # larger than the default 0.02: the metric moves by O(1), not O(0.01)
    tie_word_embeddings=False,
)
"""The random non-GQA Llama both tools load (TransformerLens accepts its edges): 4 layers x 8 heads."""


class IOI(NamedTuple):
    """IOI-style pairs: clean and corrupted ids (B, L), each pair's right and wrong answer ids (B,)."""

    clean: torch.Tensor
    corrupted: torch.Tensor
    right: torch.Tensor
    wrong: torch.Tensor

    def logit_diff(self, logits: torch.Tensor) -> torch.Tensor:
        """(B,): each pair's right answer's logit minus its wrong one's at the last position."""
        last = logits[:, -1]  # (B, V)
        return last.gather(1, self.right[:, None])[:, 0] - last.gather(1, self.wrong[:, None])[:, 0]

    def pair(self, i: int) -> IOI:
        """The ``i``-th pair alone (batch 1)."""
        return IOI(*(t[i : i + 1] for t in self))

    def first(self, n: int) -> IOI:
        """The first ``n`` pairs."""
        return IOI(*(t[:n] for t in self))

    def __len__(self) -> int:  # type: ignore[override]
        return self.clean.shape[0]


def ioi_pairs(tokenizer: object, n: int = 8) -> IOI:
    """``n`` IOI-style pairs: template ``i % 4`` with the names ``NAMES[2i % 16]`` (answer) and the next one.

    Every prompt has the same length (checked), so the pairs form one batch."""
    clean, corrupted, right, wrong = [], [], [], []
    for i in range(n):
        a, b = NAMES[(2 * i) % len(NAMES)], NAMES[(2 * i + 1) % len(NAMES)]
        ids = [tokenizer(x).input_ids for x in (a, b)]
        if any(len(t) != 1 for t in ids):
            raise ValueError(f"names must be one token each, got {a!r} -> {ids[0]}, {b!r} -> {ids[1]}")
        template = TEMPLATES[i % len(TEMPLATES)]
        clean.append(tokenizer(template.format(a=a, b=b, s=b)).input_ids)
        corrupted.append(tokenizer(template.format(a=a, b=b, s=a)).input_ids)
        right.append(ids[0][0])
        wrong.append(ids[1][0])
    lengths = {len(x) for x in clean + corrupted}
    if len(lengths) != 1:
        raise ValueError(f"the prompts differ in length ({sorted(lengths)}): pick templates of equal length")
    return IOI(torch.tensor(clean), torch.tensor(corrupted), torch.tensor(right), torch.tensor(wrong))


def real_text(tokenizer: object, length: int) -> torch.Tensor:
    """Token ids (1, ``length``) of real English the project did not write: the docstrings of Python's
    ``argparse`` and ``unittest`` modules (575 + 484 SmolLM2 tokens), cut to the first ``length``."""
    import argparse
    import unittest

    text = inspect.getdoc(argparse) + "\n\n" + inspect.getdoc(unittest)
    ids = tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] < length:
        raise ValueError(f"length: the text has {ids.shape[1]} tokens, asked for {length}")
    return ids[:, :length]


def save_random_llama(folder: Path, tokenizer_folder: str, seed: int = 0) -> Path:
    """A random non-GQA Llama (:data:`RANDOM_LLAMA`, SmolLM2's vocabulary) saved with ``save_pretrained``
    into ``folder`` with SmolLM2's tokenizer (TransformerLens's boot loads a tokenizer from the folder)."""
    import transformers as T

    tokenizer = T.AutoTokenizer.from_pretrained(tokenizer_folder)
    config = T.LlamaConfig(vocab_size=len(tokenizer), **RANDOM_LLAMA)
    torch.manual_seed(seed)
    T.LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def gradients(
    bridge: torch.nn.Module,
    ids: torch.Tensor,
    metric: Callable[[torch.Tensor], torch.Tensor],
    points: Iterable[str],
) -> dict[tuple[int, str], torch.Tensor]:
    """{(layer, point): gradient in multihead's layout} of the per-example ``metric`` summed over the batch,
    through ``cache_activation_and_gradient`` (points as :data:`lens_peer.HOOKS` maps them)."""
    from transformer_lens.tools.analysis import attribution_patching as ap

    wanted = {hook_name(layer, p): (layer, p) for layer in range(bridge.cfg.n_layers) for p in points}
    got = ap.cache_activation_and_gradient(bridge, ids, lambda logits: metric(logits).sum(), list(wanted))
    return {key: to_multihead(key[1], got.gradients[name]) for name, key in wanted.items()}


def _per_pair(bridge: torch.nn.Module, data: IOI, granularity: str, metric: Callable | None = None) -> list:
    """TransformerLens's ``attribution_patch`` on each pair with that pair's metric: its results."""
    from transformer_lens.tools.analysis import attribution_patching as ap

    config = ap.EdgeAttributionConfig(granularity=granularity)
    out = []
    for i in range(len(data)):
        one = data.pair(i)
        fn = metric or (lambda logits, one=one: one.logit_diff(logits)[0])
        out.append(ap.attribution_patch(bridge, one.clean, one.corrupted, fn, config))
    return out


def node_scores(bridge: torch.nn.Module, data: IOI) -> torch.Tensor:
    """(layers, H, L): every head's node score at every position (its ``attn.hook_z``), the mean over the
    pairs; multihead's ``attribution_patch(per_position=True)`` minus the metric's corrupted mean."""
    cfg = bridge.cfg
    out = torch.zeros(cfg.n_layers, cfg.n_heads, data.clean.shape[1], dtype=torch.float64)
    for result in _per_pair(bridge, data, "node"):
        for node, score in result.node_scores.items():
            if node.kind == "attn_head_out":
                out[node.layer, node.head, node.position] += score
    return out / len(data)


def ours_node(node: object) -> Node:
    """multihead's node of a TransformerLens node (its position dropped)."""
    kind, layer, head = node.kind, node.layer, node.head
    table = {
        "embed": (EMBED, "embed"),
        "attn_head_out": (ATTN.format(layer), "head"),
        "mlp_out": (MLP.format(layer), "mlp"),
        "q_input": (ATTN.format(layer), "q"),
        "k_input": (ATTN.format(layer), "k"),
        "v_input": (ATTN.format(layer), "v"),
        "mlp_in": (MLP.format(layer), "mlp"),
        "logits": (UNEMBED, "logits"),
    }
    name, ours = table[kind]
    return Node(name, ours, head)


def edge_scores(bridge: torch.nn.Module, data: IOI) -> dict[tuple[Node, Node], float]:
    """{(writer, reader): score} in multihead's nodes: TransformerLens's per-position edge scores summed over
    the positions, the mean over the pairs."""
    out: dict[tuple[Node, Node], float] = {}
    results = _per_pair(bridge, data, "edge")
    for result in results:
        for (writer, reader), score in result.edge_scores.items():
            key = (ours_node(writer), ours_node(reader))
            out[key] = out.get(key, 0.0) + score / len(results)
    return out


def tl_circuit(bridge: torch.nn.Module, edges: Iterable[tuple[Node, Node]], length: int) -> list[tuple]:
    """multihead's edges (writer, reader) as TransformerLens's: the same pair at every position."""
    from transformer_lens.tools.analysis import attribution_patching as ap

    kinds = {"embed": "embed", "head": "attn_head_out", "mlp": "mlp_out"}
    readers = {"q": "q_input", "k": "k_input", "v": "v_input", "mlp": "mlp_in", "logits": "logits"}
    last = bridge.cfg.n_layers - 1

    def layer(node: Node) -> int | None:
        return (
            last if node.kind == "logits" else int(node.name.split(".")[2]) if node.kind != "embed" else None
        )

    out = []
    for writer, reader in edges:
        for p in range(length):
            w = ap.Node(kind=kinds[writer.kind], position=p, layer=layer(writer), head=writer.head)
            r = ap.Node(kind=readers[reader.kind], position=p, layer=layer(reader), head=reader.head)
            out.append((w, r))
    return out


def faithfulness(bridge: torch.nn.Module, data: IOI, edges: Iterable[tuple[Node, Node]]) -> list[float]:
    """TransformerLens's recovered fraction of each pair (it takes one at a time) with multihead's ``edges``
    kept at every position."""
    from transformer_lens.tools.analysis import attribution_patching as ap

    circuit = tl_circuit(bridge, list(edges), data.clean.shape[1])
    out = []
    for i in range(len(data)):
        one = data.pair(i)
        result = ap.faithfulness(
            bridge, one.clean, one.corrupted, lambda x, one=one: one.logit_diff(x)[0], circuit
        )
        out.append(result.recovered)
    return out


def refusal(bridge: torch.nn.Module, data: IOI) -> str:
    """TransformerLens's refusal of edge attribution on ``bridge`` (its message), or "accepted"."""
    from transformer_lens.tools.analysis import attribution_patching as ap

    one = data.pair(0)
    config = ap.EdgeAttributionConfig(granularity="edge")
    try:
        ap.attribution_patch(bridge, one.clean, one.corrupted, lambda x: one.logit_diff(x)[0], config)
    except ValueError as exc:
        return f"ValueError: {exc}"
    return "accepted"


def ig_refusal() -> str:
    """TransformerLens's answer to ``ig_steps=5`` (integrated gradients)."""
    from transformer_lens.tools.analysis import attribution_patching as ap

    try:
        ap.EdgeAttributionConfig(granularity="edge", ig_steps=5)
    except NotImplementedError as exc:
        return f"NotImplementedError: {exc}"
    return "accepted"
