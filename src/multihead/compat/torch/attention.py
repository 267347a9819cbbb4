"""``MultiheadAttention``: a drop-in for ``torch.nn.MultiheadAttention`` over :func:`multihead.attention`.

Dimensions: N batch, L target (query) length, S source (key) length, S' = S + 1 per ``add_bias_kv`` and
per ``add_zero_attn``, E embed_dim, H heads, D = E // H head dim.

Same constructor, same ``forward`` and returns, same ``state_dict`` keys and shapes (checkpoints load
both ways with ``load_state_dict``). torch's mask conventions are translated here, at the boundary:

===================  ==============================  =====================================
torch argument       torch meaning                   passed to :func:`multihead.attention`
===================  ==============================  =====================================
bool attn_mask       ``True`` = may NOT attend       ``mask=~attn_mask``
float attn_mask      added to the scores             ``bias=attn_mask``
bool key_padding     ``True`` = padding              ``mask=~kpm[:, None, None, :]``
float key_padding    added to the scores             ``bias=kpm[:, None, None, :]``
is_causal            hint that attn_mask is causal   top-left causal mask (see ``forward``)
===================  ==============================  =====================================

The one intended difference: a query row that may attend to no key gets output 0 and weights 0 here,
where torch returns NaN.

Nested tensors (``torch.nested``, jagged or strided layout; one component (L_i, E) per sequence) are
accepted with ``batch_first=True`` and no masks, in training and inference, with or without autograd:
attention runs over each sequence's real tokens only and the output is a nested tensor of the query's
layout (torch takes them only on its inference fast path). Errors are raised as torch's class *and* the
library's (:mod:`.boundary`, :mod:`.checks`): a bad shape torch asserts is a :class:`MultiheadAttentionError`
(``ValueError`` and ``AssertionError``), one torch finds as it computes (an ``attn_mask`` of the wrong shape, a
key of another batch size) also a ``RuntimeError``, a query of another dtype a ``TypeError`` and a
``RuntimeError``; the message is torch's text followed by the fix.

Inside torch's own layers (``nn.TransformerEncoderLayer`` and the rest) the drop-in is always called: torch's
fused inference kernel for the encoder layer (``torch._transformer_encoder_layer_fwd``, which reads the
attention's weights and never calls the attention module) is never taken around it (see
:func:`_always_call_me`), so multihead computes every attention and inspectors see every call.
``nn.TransformerEncoder``'s nested-tensor path (``enable_nested_tensor``, eval, padding mask) still runs:
it hands each layer a nested tensor, which the drop-in takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...core.attention import AttentionOutput, attention, output_and_weights
from ...core.masks import causal, combine
from ...nn import seam
from ...nn.attention import MultiHeadAttention as _CoreMHA
from ...nn.attention import map_inputs, merge_heads, split_heads
from .boundary import (
    FastPathShapeError,
    InputDtypeError,
    IsCausalError,
    MultiheadAttentionError,
    MultiheadAttentionRuntimeError,
    _keep_and_bias,
    _pad_keys,
    _torch_says,
)
from .checks import check_call, check_key_and_value

__all__ = ["MultiheadAttention", "torch_attention"]


def _always_call_me(module: nn.Module, args: tuple[object, ...]) -> None:
    """The drop-in's forward pre-hook; it does nothing.

    ``nn.TransformerEncoderLayer.forward`` skips its fused inference kernel when any module inside the layer
    carries a forward hook ("forward pre-/hooks are attached to the module"); that kernel would read this
    module's weights and bypass its ``forward``, so an open ``viz.capture`` or ``heads.masked`` would see
    nothing. With this hook the layer takes its plain path, which calls the drop-in. The check is torch's
    own, not a promise: tests/test_compat_torch_layers.py replaces the kernel with one that raises, so a
    torch release that dropped the check would fail there, on every torch the suite runs on.
    """
    return None


def _flags(m: nn.Module) -> dict[str, object]:
    """Constructor keywords (all but embed_dim, num_heads) that rebuild ``m``, either class, in place."""
    ref = m.out_proj.weight
    return {
        "dropout": m.dropout,
        "bias": m.in_proj_bias is not None,
        "add_bias_kv": m.bias_k is not None,
        "add_zero_attn": m.add_zero_attn,
        "kdim": m.kdim,
        "vdim": m.vdim,
        "batch_first": m.batch_first,
        "device": ref.device,
        "dtype": ref.dtype,
    }


def torch_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    dropout: float = 0.0,
    return_weights: bool = False,
    **kwargs: object,
) -> Tensor | AttentionOutput:
    """:func:`multihead.attention` with torch's training-mode weights: with dropout and returned weights,
    torch returns the *dropped-out* weights and multiplies those by ``v``; otherwise the same call.

    q (N, H, L, D), k (N, H, S, D), v (N, H, S, D) -> (N, H, L, D) [and weights (N, H, L, S)].
    """
    if not (return_weights and dropout > 0):
        return attention(q, k, v, dropout=dropout, return_weights=return_weights, **kwargs)  # type: ignore[arg-type]
    kwargs.pop("backend", None)
    _, weights = output_and_weights(attention(q, k, v, return_weights=True, **kwargs))  # type: ignore[arg-type]
    assert weights is not None
    weights = F.dropout(weights, p=dropout)  # (N, H, L, S)
    return AttentionOutput(torch.matmul(weights, v), weights)  # (N, H, L, D)


def _nested_like(query: Tensor, parts: list[Tensor]) -> Tensor:
    """N components (L_i, E) as a nested tensor of the query's layout (N, L*, E). A jagged result shares the
    query's offsets, so torch's layers can add it to the query (``x + self_attn(x)``): jagged tensors of
    equal lengths but separate offsets are different shapes to torch."""
    if query.layout == torch.jagged:
        lens = [t.shape[0] for t in parts]
        return torch.nested.nested_tensor_from_jagged(
            torch.cat(parts), offsets=query.offsets(), min_seqlen=min(lens), max_seqlen=max(lens)
        )  # (N, L*, E)
    return torch.nested.as_nested_tensor(parts, layout=query.layout)  # (N, L*, E)


class MultiheadAttention(_CoreMHA):
    """Drop-in for ``torch.nn.MultiheadAttention`` (same arguments, returns and ``state_dict``).

    Args:
        embed_dim: E, which ``num_heads`` must divide.
        num_heads: H.
        dropout: dropout on the attention weights (training mode only).
        bias: biases on the input and output projections.
        add_bias_kv: learn one extra key and value, ``bias_k``/``bias_v`` (1, 1, E), appended to the keys.
        add_zero_attn: append a zero key and value after the projections.
        kdim, vdim: key/value feature sizes (default E).
        batch_first: inputs and outputs are (N, L, E) instead of (L, N, E).
        device, dtype: factory arguments.

    Forward (batched, ``batch_first=False``): query (L, N, E), key (S, N, kdim), value (S, N, vdim);
    unbatched: (L, E), (S, kdim), (S, vdim). Returns ``(attn_output, attn_weights)``: (L, N, E) and, with
    ``need_weights``, (N, L, S') averaged over heads or (N, H, L, S') per head; else ``None``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if (
            isinstance(embed_dim, int)
            and isinstance(num_heads, int)
            and num_heads > 0
            and embed_dim % num_heads
        ):
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}), as in "
                f"torch.nn.MultiheadAttention; multihead.MultiHeadAttention(head_dim=...) lifts this limit"
            )
        super().__init__(
            embed_dim,
            num_heads,
            kdim=kdim,
            vdim=vdim,
            bias=bias,
            dropout=dropout,
            attention_fn=torch_attention,
            device=device,
            dtype=dtype,
        )
        self.batch_first = bool(batch_first)
        self.add_zero_attn = bool(add_zero_attn)
        self.bias_k: Tensor | None = None  # torch keeps these plain None attributes without add_bias_kv
        self.bias_v: Tensor | None = None
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, device=device, dtype=dtype))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, device=device, dtype=dtype))
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)
        self.register_forward_pre_hook(_always_call_me)

    def __setstate__(self, state: dict[str, object]) -> None:
        """Unpickling: a module pickled before the drop-in carried :func:`_always_call_me` gets it too."""
        super().__setstate__(state)
        if _always_call_me not in self._forward_pre_hooks.values():
            self.register_forward_pre_hook(_always_call_me)

    def reset_parameters(self) -> None:
        """torch's initialisation: Xavier-uniform projections, zero biases, Xavier-normal bias_k/bias_v."""
        super().reset_parameters()
        for p in (getattr(self, "bias_k", None), getattr(self, "bias_v", None)):
            if p is not None:
                nn.init.xavier_normal_(p)

    def extra_repr(self) -> str:
        flags = [f"batch_first={self.batch_first}"]
        if self.bias_k is not None:
            flags.append("add_bias_kv=True")
        if self.add_zero_attn:
            flags.append("add_zero_attn=True")
        return super().extra_repr() + ", " + ", ".join(flags)

    # ------------------------------------------------------------------------------------------

    def _masks(
        self,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        is_causal: bool,
        need_weights: bool,
        n: int,
        lq: int,
        lk: int,
        extra: int,
        query: Tensor,
    ) -> tuple[Tensor | None, Tensor | None, bool]:
        """torch's masks to (keep (N|1, H|1, L, S'), bias, causal) in the library's convention."""
        if is_causal and attn_mask is None:
            raise IsCausalError(
                "is_causal=True needs attn_mask (torch's rule: is_causal is a hint that attn_mask is the "
                "causal mask); pass attn_mask=nn.Transformer.generate_square_subsequent_mask(L)"
            )
        kpm_keep, kpm_bias = _keep_and_bias(key_padding_mask, "key_padding_mask", query.dtype)
        if is_causal and key_padding_mask is None and not need_weights:
            # torch hands is_causal to SDPA and drops attn_mask: a top-left causal mask over all S' keys,
            # which is the library's (bottom-right) causal=True when L == S' (then ring attention serves it).
            if lq == lk + extra:
                return None, None, True
            top_left = causal(lq, lk + extra, diagonal=0, device=query.device)  # (L, S')
            return top_left, None, False
        am_keep, am_bias = _keep_and_bias(attn_mask, "attn_mask", query.dtype)
        am = attn_mask
        if am is not None:
            want = (lq, lk) if am.dim() == 2 else (n * self.num_heads, lq, lk)
            if tuple(am.shape) != want:
                raise _torch_says(
                    f"Expected `attn_mask` shape to be {want} but got {tuple(am.shape)}",
                    f"A {am.dim()}-D attn_mask is {'(L, S)' if am.dim() == 2 else '(N*num_heads, L, S)'} with "
                    f"L = {lq}, S = {lk}; for one mask per batch element, repeat it per head: "
                    f"attn_mask.repeat_interleave(num_heads, dim=0)",
                    MultiheadAttentionRuntimeError,  # torch finds it as it computes
                )
            if am.dim() == 3:  # (N*H, L, S) -> (N, H, L, S), row n*H + h is batch n, head h
                am_keep = None if am_keep is None else am_keep.view(n, self.num_heads, lq, lk)
                am_bias = None if am_bias is None else am_bias.view(n, self.num_heads, lq, lk)
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (n, lk):
                raise _torch_says(
                    f"expecting key_padding_mask shape of {(n, lk)}, but got {tuple(key_padding_mask.shape)}",
                    "key_padding_mask is (N, S): one row per batch element, one column per key",
                    FastPathShapeError,
                )
            kpm_keep = None if kpm_keep is None else kpm_keep[:, None, None, :]  # (N, 1, 1, S)
            kpm_bias = None if kpm_bias is None else kpm_bias[:, None, None, :]  # (N, 1, 1, S)
        keep = combine(am_keep, kpm_keep)
        bias = am_bias if kpm_bias is None else (kpm_bias if am_bias is None else am_bias + kpm_bias)
        return (*_pad_keys(keep, bias, extra), False)

    def forward(  # type: ignore[override]
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """torch.nn.MultiheadAttention.forward, with the same arguments and returns.

        Masks (torch's meaning): ``key_padding_mask`` (N, S) [unbatched (S,)], bool ``True`` = ignore
        this key, or float added to the scores; ``attn_mask`` (L, S) or (N*num_heads, L, S) [unbatched
        (num_heads, L, S)], bool ``True`` = may not attend, or float added (in the query's dtype). With
        L = S = 3, a bool causal ``attn_mask`` is::

            0 1 1
            0 0 1
            0 0 0

        ``is_causal=True`` requires ``attn_mask`` (as in torch). Like torch, when no
        ``key_padding_mask`` is given and ``need_weights=False`` it replaces ``attn_mask`` by a top-left
        causal mask; otherwise ``attn_mask`` is used as given.

        Nested query/key/value (``batch_first=True``, no masks): components (L_i, E), (S_i, kdim),
        (S_i, vdim); the output is nested, (L_i, E) per sequence, and the weights (if requested) are
        dense, (N, max L_i, max S_i') with zeros outside each sequence's block, as torch returns them.
        With ``need_weights=False`` the sequences are packed into one row and attend in one call, kept
        apart by ``segment_ids``; with weights, each sequence attends alone (its weights are its block).

        Returns ``(attn_output, attn_weights)``; weights with ``need_weights`` only (in training mode with
        dropout > 0 they are the dropped-out weights, as in torch). Rows with no allowed key: zeros.
        """
        if any(isinstance(t, Tensor) and t.is_nested for t in (query, key, value)):
            return self._forward_nested(
                query, key, value, key_padding_mask, attn_mask, is_causal, need_weights, average_attn_weights
            )
        batched = check_call(self, query, key, value, key_padding_mask, attn_mask)
        check_key_and_value(self, query, key, value, batched)
        if batched and not self.batch_first:
            query, key, value = map_inputs(lambda t: t.transpose(0, 1), query, key, value)  # (N, L, E)
        elif not batched:
            query, key, value = map_inputs(lambda t: t.unsqueeze(0), query, key, value)  # (1, L, E)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)  # (1, S)
        try:  # shapes are checked: what is left is a dtype (torch's projection: RuntimeError) or a device
            self._check_inputs(query, key, value)
        except TypeError as e:
            raise InputDtypeError(str(e)) from None
        except ValueError as e:
            raise MultiheadAttentionError(str(e)) from None
        n, lq, lk = query.shape[0], query.shape[1], key.shape[1]
        keep, bias, causal = self._masks(
            key_padding_mask, attn_mask, is_causal, need_weights, n, lq, lk, self._extra_keys(), query
        )
        out, weights = self._attend(query, key, value, keep, bias, causal, need_weights)
        if not batched:
            out = out.squeeze(0)  # (L, E)
        elif not self.batch_first:
            out = out.transpose(0, 1)  # (L, N, E)
        if weights is None:
            return out, None
        if average_attn_weights:
            weights = weights.mean(dim=1)  # (N, L, S')
        return out, (weights if batched else weights.squeeze(0))

    def _extra_keys(self) -> int:
        """Keys appended after the projections: one for ``add_bias_kv``, one for ``add_zero_attn``."""
        extra = int(self.bias_k is not None) + int(self.add_zero_attn)
        if extra and seam.is_sharded(self.attention_fn):
            raise ValueError(
                "add_bias_kv / add_zero_attn append a key to the sequence, which ring attention over sharded "
                "sequences would append once per rank; run this module in a single process"
            )
        return extra

    def _attend(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        keep: Tensor | None,
        bias: Tensor | None,
        causal: bool,
        need_weights: bool,
        segment_ids: tuple[Tensor, Tensor] | None = None,
        copies: int = 1,
    ) -> tuple[Tensor, Tensor | None]:
        """Batch-first inputs (N, L, E), (N, S, kdim), (N, S, vdim) and library-convention masks over S'
        keys -> output (N, L, E) and per-head weights (N, H, L, S') or None.

        ``add_bias_kv`` and ``add_zero_attn`` append ``copies`` keys each (C): one per packed sequence
        when ``segment_ids`` (q_ids (N, L), kv_ids (N, S + extra*C)) pack several sequences in a row.
        """
        n = query.shape[0]
        q, k, v = self.project(query, key, value)  # (N, H, L, D), (N, H, S, D), (N, H, S, D)
        if self.bias_k is not None and self.bias_v is not None:
            added = (n, self.num_heads, copies, self.head_dim)
            k = torch.cat(
                [k, self.bias_k.view(1, self.num_heads, 1, -1).expand(added)], dim=2
            )  # (N, H, S+C, D)
            v = torch.cat(
                [v, self.bias_v.view(1, self.num_heads, 1, -1).expand(added)], dim=2
            )  # (N, H, S+C, D)
        if self.add_zero_attn:
            k = F.pad(k, (0, 0, 0, copies))  # (N, H, S', D)
            v = F.pad(v, (0, 0, 0, copies))  # (N, H, S', D)
        out_heads, weights = seam.attend(
            self,
            q,
            k,
            v,
            mask=keep,
            bias=bias,
            causal=causal,
            segment_ids=segment_ids,
            dropout=self.dropout if self.training else 0.0,
            return_weights=need_weights,
        )  # (N, H, L, D), (N, H, L, S') | None
        return self.out_proj(merge_heads(out_heads)), weights  # (N, L, E)

    def project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The library's projections; an ``in_proj_bias`` in another dtype than the input is added with
        type promotion, as torch's projection does (a float16 bias on a float64 module gives float64)."""
        b = self.in_proj_bias
        if b is None or b.dtype == query.dtype:
            return super().project(query, key, value)
        (wq, wk, wv), (bq, bk, bv) = self.proj_weights(), self.proj_biases()
        q, k, v = (
            F.linear(x, w) + bx  # (N, L, H*D), promoted like torch's matmul + bias
            for x, w, bx in ((query, wq, bq), (key, wk, bk), (value, wv, bv))
        )
        return split_heads(q, self.num_heads), split_heads(k, self.kv_heads), split_heads(v, self.kv_heads)

    # ------------------------------------------------------------------------------------------
    # nested tensors

    def _forward_nested(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        is_causal: bool,
        need_weights: bool,
        average_attn_weights: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """Nested (N, L*, E) inputs: each sequence attends over its own real tokens; nested output."""
        check_call(self, query, key, value, key_padding_mask, attn_mask)
        if not all(t.is_nested for t in (query, key, value)):
            raise _torch_says(
                "MultiheadAttention got a NestedTensor mixed with a dense tensor",
                "pass query, key and value all nested (one component per sequence), or all dense",
            )
        if not self.batch_first:
            raise _torch_says(
                "MultiheadAttention does not support NestedTensor with batch_first=False",
                "a nested tensor is batch first (component i is sequence i, (L_i, E)): build the module "
                "with batch_first=True",
            )
        if key_padding_mask is not None or attn_mask is not None or is_causal:
            raise _torch_says(
                "MultiheadAttention does not support NestedTensor with key_padding_mask or attn_mask",
                "a nested tensor carries each sequence's length, so no key_padding_mask is needed; for "
                "another mask pad the inputs to dense tensors (`nt.to_padded_tensor(0.0)`) and pass it",
            )
        qs = query.unbind()  # N components (L_i, E); one unbind per distinct tensor keeps `key is query`
        ks = qs if key is query else key.unbind()  # (S_i, kdim)
        vs = ks if value is key else value.unbind()  # (S_i, vdim)
        if not len(qs) == len(ks) == len(vs):
            raise _torch_says(
                f"query, key and value must hold the same number of sequences, got {len(qs)}, {len(ks)} "
                f"and {len(vs)}",
                "component i of each is sequence i",
            )
        extra = self._extra_keys()
        if not need_weights:
            return self._packed(query, qs, ks, vs, extra), None
        outs, weights = [], []
        for qi, ki, vi in zip(qs, ks, vs):  # the weights are per sequence: (L_i, S_i') blocks
            one = map_inputs(lambda t: t.unsqueeze(0), qi, ki, vi)  # (1, L_i, E), (1, S_i, *), (1, S_i, *)
            self._check_inputs(*one)
            out, w = self._attend(*one, None, None, False, True)  # (1, L_i, E), (1, H, L_i, S_i')
            outs.append(out.squeeze(0))  # (L_i, E)
            weights.append(w)
        nested = _nested_like(query, outs)  # (N, L*, E)
        lq, ls = max(q.shape[0] for q in qs), max(k.shape[0] for k in ks) + extra
        dense = outs[0].new_zeros(len(qs), self.num_heads, lq, ls)  # (N, H, max L, max S')
        for i, w in enumerate(weights):
            assert w is not None
            dense[i, :, : w.shape[2], : w.shape[3]] = w[0]
        return nested, (dense.mean(dim=1) if average_attn_weights else dense)

    def _packed(
        self,
        query: Tensor,
        qs: tuple[Tensor, ...],
        ks: tuple[Tensor, ...],
        vs: tuple[Tensor, ...],
        extra: int,
    ) -> Tensor:
        """All N sequences in one row and one attention call: ``segment_ids`` keep them apart, so every
        query sees only its own sequence's keys (and its own copy of the appended keys); no padding."""
        n, dev = len(qs), qs[0].device
        q_in = torch.cat(qs).unsqueeze(0)  # (1, sum L_i, E)
        k_in = q_in if ks is qs else torch.cat(ks).unsqueeze(0)  # (1, sum S_i, kdim)
        v_in = k_in if vs is ks else torch.cat(vs).unsqueeze(0)  # (1, sum S_i, vdim)
        self._check_inputs(q_in, k_in, v_in)
        seq = torch.arange(n, device=dev)  # (N,)
        q_lens = torch.tensor([t.shape[0] for t in qs], device=dev)  # (N,)
        k_lens = torch.tensor([t.shape[0] for t in ks], device=dev)  # (N,)
        q_ids = seq.repeat_interleave(q_lens)  # (sum L_i,)
        kv_ids = torch.cat([seq.repeat_interleave(k_lens), *[seq] * extra])  # (sum S_i + extra*N,)
        out, _ = self._attend(
            q_in, k_in, v_in, None, None, False, False, segment_ids=(q_ids[None], kv_ids[None]), copies=n
        )  # (1, sum L_i, E)
        return _nested_like(query, list(out[0].split(q_lens.tolist())))  # (N, L*, E) from N x (L_i, E)

    # ------------------------------------------------------------------------------------------

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> MultiheadAttention:  # type: ignore[override]
        """A drop-in copy of ``m``: same flags (batch_first, add_bias_kv, ...) and exact weights."""
        if not isinstance(m, nn.MultiheadAttention):
            raise TypeError(f"from_torch expects a torch.nn.MultiheadAttention, got {type(m).__name__}")
        new = cls(m.embed_dim, m.num_heads, **_flags(m))
        new.load_state_dict(m.state_dict(), strict=True)
        return new.train(m.training)

    def pruned(self) -> bool:
        """Whether :func:`multihead.heads.prune` removed heads (num_heads * head_dim < embed_dim)."""
        return self.num_heads * self.head_dim != self.embed_dim

    def to_torch(self) -> nn.MultiheadAttention:
        """A ``torch.nn.MultiheadAttention`` with the same flags and exact weights.

        Not after :func:`multihead.heads.prune` removed heads: torch needs num_heads * head_dim == embed_dim.
        """
        if self.pruned():
            raise ValueError(
                f"torch.nn.MultiheadAttention cannot express this module: num_heads*head_dim="
                f"{self.num_heads}*{self.head_dim} != embed_dim={self.embed_dim} (heads were pruned); keep "
                f"it as multihead.compat.torch.MultiheadAttention, or revert before pruning"
            )
        m = nn.MultiheadAttention(self.embed_dim, self.num_heads, **_flags(self))
        m.load_state_dict(self.state_dict(), strict=True)
        return m.train(self.training)
