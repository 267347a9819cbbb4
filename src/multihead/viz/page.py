"""One self-contained HTML page of every attention head: data in, an HTML string out.

Dimensions: H heads, Lq query length, Lk key length.

The page works from ``file://`` with no network: the script and style are inline, written here. What it
carries of each module is made by :mod:`.encoding` (re-exported here): per-head statistics
(:func:`head_stats`), each head's weights as uint8, deflated and base64-encoded (:func:`encode_head`; a
512-token text on a 6 x 12-head model: about 2.8 MiB with the thumbnails; 1,000 tokens on a 30 x 9-head
causal LM: about 12.9 MiB), and each head's thumbnail, its weights max-pooled to at most 96 x 96 pixels,
packed the same way (:func:`thumbnail`). The page draws on canvas: a model view (the thumbnail of each
layer x head: opening the page inflates 9 KiB per head, not the head's weights), a head view
(token-to-token lines of the heads picked, opacity = weight, hover a token to focus on it; a head is
inflated by the browser's ``DecompressionStream`` only when it is shown there, a few kept in memory) and
a sortable table of per-head statistics, with head importance when given. The style, markup and script are
those of :mod:`.assets`, scoped to one view: the page is one view filling ``<body>``, and
:mod:`.inline` puts the same view in a notebook. Nothing here imports transformers or matplotlib.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .assets import MARKUP, SCRIPT, STYLE
from .encoding import (
    STAT_COLUMNS,
    THUMB,
    EncodedModule,
    PageModule,
    encode_head,
    encode_module,
    head_stats,
    thumbnail,
)

__all__ = [
    "STAT_COLUMNS",
    "THUMB",
    "EncodedModule",
    "PageModule",
    "build_page",
    "fill",
    "page_data",
    "view_markup",
    "encode_head",
    "encode_module",
    "head_stats",
    "thumbnail",
]


def page_data(
    modules: Sequence[PageModule | EncodedModule],
    sequences: Mapping[str, Sequence[str]],
    special: Mapping[str, Sequence[bool]],
    *,
    title: str = "multihead view",
    facts: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """What the view's script reads (``D``), for ``modules`` whose tokens are ``sequences[name]``.

    Args:
        modules: the attention modules in model order, with weights (H, Lq, Lk) (:class:`PageModule`) or
            already encoded (:class:`EncodedModule`, e.g. one module at a time while the model runs); Lq
            tokens of ``sequences[m.queries]`` and Lk of ``sequences[m.keys]``.
        sequences: ``{name: tokens}``, e.g. ``{"input": [...]}`` or ``{"encoder": [...], "decoder": [...]}``.
        special: ``{name: one bool per token}``: which tokens are special (for the statistics).
        title: the view's heading.
        facts: ``{label: value}`` shown under the heading (model folder, kind, token counts, ...).
    """
    if not modules:
        raise ValueError("modules is empty: nothing to show")
    meta_modules = []
    for m in modules:
        want = (len(sequences[m.queries]), len(sequences[m.keys]))
        if m.shape != want:
            raise ValueError(
                f"{m.name}: weights (H, Lq, Lk) = {(m.heads, *m.shape)} but sequences give "
                f"Lq={want[0]} ({m.queries}) and Lk={want[1]} ({m.keys})"
            )
        e = m.encode(special[m.keys])
        meta_modules.append(
            {
                "name": e.name,
                "kind": e.kind,
                "q": e.queries,
                "k": e.keys,
                "heads": e.heads,
                "stats": e.stats,
                "importance": None if e.importance is None else [round(float(x), 5) for x in e.importance],
                "blobs": list(e.blobs),
                "thumb": list(e.thumb_shape),
                "thumbs": e.thumbs,
            }
        )
    return {
        "title": title,
        "facts": dict(facts or {}),
        "sequences": {k: [str(t) for t in v] for k, v in sequences.items()},
        "special": {k: [bool(b) for b in v] for k, v in special.items()},
        "columns": STAT_COLUMNS,
        "modules": meta_modules,
    }


def view_markup(data: Mapping[str, Any], *, fallback: str = "", data_id: str | None = None) -> str:
    """The view's markup (what goes inside its ``.mhv`` root): heading, facts, the static ``fallback`` (HTML
    shown until the script runs), the parts the script fills, and the data (``<script type="application/json"
    data-p="data">``, safe inside HTML: no ``</`` in it; ``id=data_id`` too where given: the page's is
    ``mh-data``, for readers of its format)."""
    facts = "".join(
        f"<span><b>{html.escape(str(k))}: </b>{html.escape(str(v))}</span>" for k, v in data["facts"].items()
    )
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")  # safe inside <script>
    markup = fill(MARKUP, TITLE=html.escape(data["title"]), FACTS=facts, FALLBACK=fallback)
    ident = "" if data_id is None else f' id="{html.escape(data_id)}"'
    return markup + f'<script type="application/json" data-p="data"{ident}>{payload}</script>'


def fill(template: str, **parts: str) -> str:
    """``template`` with each ``{{NAME}}`` replaced by ``parts[NAME]``, in one pass (a part's own text, e.g. a
    token that reads ``{{TITLE}}``, is never replaced again)."""
    return re.sub(r"\{\{(\w+)\}\}", lambda m: parts[m.group(1)], template)


def build_page(
    modules: Sequence[PageModule | EncodedModule],
    sequences: Mapping[str, Sequence[str]],
    special: Mapping[str, Sequence[bool]],
    *,
    title: str = "multihead view",
    facts: Mapping[str, str] | None = None,
) -> str:
    """The page (an HTML string) for ``modules``, whose tokens are ``sequences[name]`` (arguments as in
    :func:`page_data`): one view filling ``<body>``, whose ``data-status`` turns ``ready`` when it is drawn
    (``"error"``, and the message logged to the console, if anything fails)."""
    data = page_data(modules, sequences, special, title=title, facts=facts)
    return fill(
        _TEMPLATE,
        TITLE=html.escape(title),
        STYLE=STYLE,
        SCRIPT=SCRIPT,
        VIEW=view_markup(data, data_id="mh-data"),
    )


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{TITLE}}</title>
<style>
body{margin:0;background:#fff}
{{STYLE}}</style></head>
<body data-status="loading">
<div class="mhv" id="mhv-page">
{{VIEW}}
</div>
<script>
"use strict";
(function () {
{{SCRIPT}}
const root = document.getElementById("mhv-page");
window.addEventListener("error", (e) => { document.body.dataset.status = "error"; });
// page.html#module=2&heads=0,3 opens the head view on module 2, heads 0 and 3
mhView(root, JSON.parse(root.querySelector('[data-p="data"]').textContent),
  { status: document.body, hash: location.hash });
})();
</script>
</body></html>
"""
