"""``MultiHeadAttention``: projections, head split/merge and grouped-query heads over :func:`attention`.

Dimensions: B batch, Lq/Lk query/key lengths, E embed_dim, H query heads, Hkv key/value heads,
Dk query/key head dim, Dv value head dim, O out_dim.

Parameter layout (the same as ``torch.nn.MultiheadAttention``, so weights copy over one to one):

* ``kdim == vdim == embed_dim``: one ``in_proj_weight`` (H*Dk + Hkv*Dk + Hkv*Dv, E), rows [q | k | v];
  self-attention computes Q, K and V with that single matrix multiply;
* otherwise ``q_proj_weight`` (H*Dk, E), ``k_proj_weight`` (Hkv*Dk, kdim), ``v_proj_weight`` (Hkv*Dv, vdim);
* ``in_proj_bias`` (H*Dk + Hkv*Dk + Hkv*Dv,) when ``bias``; ``out_proj`` = Linear(H*Dv, O).

Within each projection, head ``i`` owns rows ``[i*D, (i+1)*D)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core import backends as _backends
from ..core.attention import AttentionOutput, attention
from ..core.backends import math as _math
from ..core.checks import check_dropout, check_softcap, positive_int
from ..core.masks import check_segment_ids
from ..core.options import AttentionOptions
from ..core.segments import segment_positions
from . import seam
from .cache import KVCache
from .rotary import RotaryEmbedding

__all__ = ["MultiHeadAttention", "map_inputs", "merge_heads", "split_heads"]


def split_heads(x: Tensor, heads: int) -> Tensor:
    """(B, L, heads*D) -> (B, heads, L, D), a view."""
    b, length, features = x.shape
    return x.view(b, length, heads, features // heads).transpose(1, 2)  # (B, heads, L, D)


def merge_heads(x: Tensor) -> Tensor:
    """(B, heads, L, D) -> (B, L, heads*D)."""
    return x.transpose(1, 2).flatten(2)  # (B, L, heads*D)


def map_inputs(
    fn: Callable[[Tensor], Tensor], query: Tensor, key: Tensor, value: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``fn`` applied to query, key and value, keeping ``key is query`` and ``value is key``.

    The identities are what :meth:`MultiHeadAttention.project` reads to fuse the projections, so a
    reshape of self-attention inputs (unbatched -> batched, sequence first -> batch first) keeps them.
    """
    same_k, same_v = key is query, value is key
    query = fn(query)
    key = query if same_k else fn(key)
    value = key if same_v else fn(value)
    return query, key, value


class MultiHeadAttention(nn.Module):
    """Multi-head attention with grouped-query heads, every mask kind and exact torch interop.

    Args:
        embed_dim: E, the query feature size (and the output size unless ``out_dim``).
        num_heads: H query heads.
        kv_heads: Hkv key/value heads (default H); H % Hkv == 0. 1 is multi-query attention.
        kdim, vdim: key/value input feature sizes (default E).
        head_dim: Dk per head (default E // H, which then must divide).
        v_head_dim: Dv per head (default Dk).
        out_dim: O, output features (default E).
        bias: biases on the input and output projections.
        dropout: dropout on the attention weights, in training mode only.
        rotary: rotary position embeddings (:class:`~multihead.nn.rotary.RotaryEmbedding`) on queries and
            keys; positions are bottom-right aligned like ``causal`` and continue a ``cache``; with
            ``segment_ids`` they restart at 0 in each packed sequence. Needs an even head_dim; adds no
            parameters.
        softcap: ``None`` or c > 0: scores -> c * tanh(scores / c) (Gemma 2).
        sinks: a learnable per-head sink logit ``sinks`` (H,), initialised to zeros, in every softmax
            denominator (gpt-oss).
        backend: the attention backend's name, ``"auto"`` (default) or one of
            ``multihead.core.backends.available()``; the attribute ``backend`` may be changed later.
        device, dtype: factory arguments for the parameters.

    Forward: ``query`` (B, Lq, E) [or unbatched (Lq, E)], ``key`` (B, Lk, kdim), ``value`` (B, Lk, vdim);
    ``key``/``value`` default to ``query`` (self-attention). Masks follow :func:`multihead.attention`:
    ``mask`` bool (True = may attend) broadcastable to (B, H, Lq, Lk) or a mask function, ``bias`` float
    or a bias function, ``valid_lens`` (B,) or (B, Lq), ``causal`` bottom-right aligned, ``segment_ids``
    (B, L) or (q_ids (B, Lq), kv_ids (B, Lk)) for packed sequences. Returns (B, Lq, O), or
    ``AttentionOutput(output, weights (B, H, Lq, Lk))`` with ``return_weights=True``.

    ``cache`` (a :class:`~multihead.KVCache`) enables incremental decoding: a dynamic cache appends
    this call's keys/values and attends to all of them (use ``causal=True``: bottom-right aligned, the
    new queries see every earlier key); a filled static cache (cross-attention) is reused as is and the
    key/value projection is skipped.

    ``attention_fn`` (constructor keyword and attribute, default :func:`multihead.attention`): the
    function that computes attention from the projected heads, with :func:`multihead.attention`'s
    signature; every call goes through :func:`multihead.nn.seam.attend`, which also applies the active
    inspection (capture, head gates). Ring attention plugs in here
    (:func:`multihead.distributed.use_process_group`). ``backend`` (constructor keyword and attribute,
    default ``"auto"``) is passed to it.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kv_heads: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        head_dim: int | None = None,
        v_head_dim: int | None = None,
        out_dim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        rotary: bool = False,
        attention_fn: seam.AttentionFn | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        softcap: float | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = positive_int("embed_dim", embed_dim)
        self.num_heads = positive_int("num_heads", num_heads)
        self.kv_heads = positive_int("kv_heads", num_heads if kv_heads is None else kv_heads)
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be divisible by kv_heads ({kv_heads}): each key/value head "
                f"serves num_heads // kv_heads query heads; pick kv_heads from the divisors of num_heads"
            )
        if head_dim is None and embed_dim % num_heads:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}), or pass head_dim= "
                f"explicitly (e.g. head_dim={max(1, embed_dim // num_heads)})"
            )
        self.head_dim = positive_int("head_dim", embed_dim // num_heads if head_dim is None else head_dim)
        self.v_head_dim = positive_int("v_head_dim", self.head_dim if v_head_dim is None else v_head_dim)
        self.kdim = positive_int("kdim", embed_dim if kdim is None else kdim)
        self.vdim = positive_int("vdim", embed_dim if vdim is None else vdim)
        self.out_dim = positive_int("out_dim", embed_dim if out_dim is None else out_dim)
        self.dropout = check_dropout(dropout)
        self.softcap = check_softcap(softcap)
        if not isinstance(backend, str) or (backend != "auto" and backend not in _backends.available()):
            raise ValueError(f"backend must be 'auto' or one of {_backends.available()}, got {backend!r}")
        self.backend = backend
        if not isinstance(sinks, bool):
            raise TypeError(f"sinks must be a bool (a learnable per-head sink logit or none), got {sinks!r}")
        self.rotary = RotaryEmbedding(self.head_dim) if rotary else None
        self.attention_fn: seam.AttentionFn = attention if attention_fn is None else attention_fn
        if not callable(self.attention_fn):
            raise TypeError(
                f"attention_fn must be a function with multihead.attention's signature, got "
                f"{type(attention_fn).__name__}"
            )
        seam.check_positions(self, self.attention_fn, rotary=rotary, cache=False)

        nq, nk, nv = self._proj_sizes()
        self._qkv_same_embed_dim = self.kdim == self.embed_dim and self.vdim == self.embed_dim
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(nq + nk + nv, embed_dim, **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.register_parameter("in_proj_weight", None)
            self.q_proj_weight = nn.Parameter(torch.empty(nq, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(nk, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(nv, self.vdim, **factory))
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(nq + nk + nv, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(self.num_heads * self.v_head_dim, self.out_dim, bias=bias, **factory)
        if sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads, **factory))  # (H,)
        else:
            self.register_parameter("sinks", None)
        self.reset_parameters()

    def _proj_sizes(self) -> tuple[int, int, int]:
        """Output rows of the q, k and v projections: (H*Dk, Hkv*Dk, Hkv*Dv)."""
        return (
            self.num_heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.kv_heads * self.v_head_dim,
        )

    def reset_parameters(self) -> None:
        """Xavier-uniform projections and zero biases (torch.nn.MultiheadAttention's initialisation)."""
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
        self.out_proj.reset_parameters()
        if self.out_proj.bias is not None:
            nn.init.zeros_(self.out_proj.bias)
        if self.sinks is not None:
            nn.init.zeros_(self.sinks)

    def extra_repr(self) -> str:
        parts = [f"embed_dim={self.embed_dim}", f"num_heads={self.num_heads}"]
        defaults = {
            "kv_heads": self.num_heads,
            "kdim": self.embed_dim,
            "vdim": self.embed_dim,
            "head_dim": self.embed_dim // self.num_heads,
            "v_head_dim": self.head_dim,
            "out_dim": self.embed_dim,
        }
        parts += [f"{k}={getattr(self, k)}" for k, d in defaults.items() if getattr(self, k) != d]
        if self.in_proj_bias is None:
            parts.append("bias=False")
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        if self.rotary is not None:
            parts.append("rotary=True")
        if self.softcap is not None:
            parts.append(f"softcap={self.softcap:g}")
        if self.sinks is not None:
            parts.append("sinks=True")
        if self.backend != "auto":
            parts.append(f"backend={self.backend!r}")
        return ", ".join(parts)

    # ------------------------------------------------------------------------------------------
    # Projections
    # ------------------------------------------------------------------------------------------

    def proj_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        """The q, k and v projection weights, (H*Dk, E), (Hkv*Dk, kdim), (Hkv*Dv, vdim) (views, no copy)."""
        if self._qkv_same_embed_dim:
            nq, nk, nv = self._proj_sizes()
            wq, wk, wv = self.in_proj_weight.split([nq, nk, nv])
            return wq, wk, wv
        return self.q_proj_weight, self.k_proj_weight, self.v_proj_weight

    def proj_biases(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """The q, k and v projection biases (views of ``in_proj_bias``), or three ``None``."""
        if self.in_proj_bias is None:
            return None, None, None
        bq, bk, bv = self.in_proj_bias.split(list(self._proj_sizes()))
        return bq, bk, bv

    def project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Inputs (B, L, feat) to heads: q (B, H, Lq, Dk), k (B, Hkv, Lk, Dk), v (B, Hkv, Lk, Dv).

        Self-attention (``key is value is query``) uses one fused matmul for Q, K and V; cross-attention
        with ``key is value`` uses one for K and V. Without autograd, on short rows of few tokens on the
        CPU (:func:`~multihead.core.backends.math.serves_head_major`), self-attention uses one product per
        head instead, which stores the heads head-major: faster there, and the short-row attention then
        reads them without copying.
        """
        nq, nk, nv = self._proj_sizes()
        h, hkv = self.num_heads, self.kv_heads
        if self._qkv_same_embed_dim and key is query and value is query:
            w, b = self.in_proj_weight, self.in_proj_bias
            if self.head_dim == self.v_head_dim and _math.serves_head_major(query, w, b, h, self.head_dim):
                heads = _math.project_head_major(query, w, b, h + 2 * hkv)  # (B, H+2Hkv, L, D), head-major
                return heads[:, :h], heads[:, h : h + hkv], heads[:, h + hkv :]
            qkv = F.linear(query, w, b)  # (B, L, Nq+Nk+Nv)
            q, k, v = qkv.split([nq, nk, nv], dim=-1)  # (B, L, Nq), (B, L, Nk), (B, L, Nv)
        else:
            (wq, wk, wv), (bq, bk, bv) = self.proj_weights(), self.proj_biases()
            q = F.linear(query, wq, bq)  # (B, Lq, H*Dk)
            if self._qkv_same_embed_dim and key is value:
                kv_b = None if self.in_proj_bias is None else self.in_proj_bias[nq:]
                k, v = F.linear(key, self.in_proj_weight[nq:], kv_b).split([nk, nv], dim=-1)
            else:
                k = F.linear(key, wk, bk)  # (B, Lk, Hkv*Dk)
                v = F.linear(value, wv, bv)  # (B, Lk, Hkv*Dv)
        return split_heads(q, h), split_heads(k, hkv), split_heads(v, hkv)

    # ------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        ref = self.out_proj.weight
        inputs = (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim))
        self_attention = key is query and value is query and self.kdim == self.vdim == self.embed_dim
        for name, t, feat in inputs[:1] if self_attention else inputs:  # one tensor: check it once
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3 or t.shape[-1] != feat:
                raise ValueError(
                    f"{name} must have shape (B, L, {feat}) (batch first; last dim = "
                    f"{ {'query': 'embed_dim', 'key': 'kdim', 'value': 'vdim'}[name] }), got {tuple(t.shape)}"
                )
            if t.dtype != ref.dtype:
                raise TypeError(
                    f"{name} has dtype {t.dtype} but the module's parameters are {ref.dtype}; convert the "
                    f"input with `{name}.to({ref.dtype})` or the module with `module.to({t.dtype})`"
                )
            if t.device != ref.device:
                raise ValueError(
                    f"{name} is on {t.device} but the module's parameters are on {ref.device}; move one of them"
                )
        if query.shape[0] != key.shape[0] or key.shape[:2] != value.shape[:2]:
            raise ValueError(
                f"query (B, Lq, E), key (B, Lk, kdim) and value (B, Lk, vdim) must share B, and key/value Lk; "
                f"got query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
            )

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        bias: Tensor | None = None,
        valid_lens: Tensor | None = None,
        causal: bool = False,
        segment_ids: Tensor | tuple[Tensor, Tensor] | None = None,
        cache: object | None = None,
        return_weights: bool = False,
    ) -> Tensor | AttentionOutput:
        """Attend ``query`` (B, Lq, E) to ``key``/``value`` (B, Lk, *); see the class docstring."""
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a multihead.KVCache, got {type(cache).__name__}")
        key = query if key is None else key
        value = key if value is None else value
        unbatched = isinstance(query, Tensor) and query.dim() == 2
        if unbatched:
            query, key, value = map_inputs(lambda t: t.unsqueeze(0), query, key, value)  # (1, L, *)
        self._check_inputs(query, key, value)
        if cache is not None and cache.static and cache.keys is not None:  # K/V of this source are cached
            key, value = key[:, :0], value[:, :0]  # (B, 0, kdim), (B, 0, vdim): nothing left to project

        seam.check_positions(self, self.attention_fn, rotary=self.rotary is not None, cache=cache is not None)
        q, k, v = self.project(query, key, value)  # (B, H, Lq, Dk), (B, Hkv, Lk, Dk), (B, Hkv, Lk, Dv)
        if cache is not None and cache.fixed_shape:  # the storage's unwritten positions hidden here
            q, k, v, valid_lens, causal = self._fixed_cache(q, k, v, cache, causal, valid_lens, segment_ids)
        elif cache is not None or self.rotary is not None:
            q, k, v = self._rotate_and_cache(q, k, v, cache, segment_ids)
        softcap, sinks, dropout = self.softcap, self.sinks, self.dropout if self.training else 0.0
        plain = mask is None and bias is None and valid_lens is None and segment_ids is None
        if plain and softcap is None and sinks is None:  # a shared record: nothing per call in it
            options = AttentionOptions.unmasked(causal, None, dropout, return_weights)
        else:
            options = AttentionOptions(
                mask=mask,
                bias=bias,
                valid_lens=valid_lens,
                causal=causal,
                segment_ids=segment_ids,
                softcap=softcap,
                sinks=sinks,
                dropout=dropout,
                return_weights=return_weights,
            )
        out_heads, weights = seam.attend(self, q, k, v, options)  # (B, H, Lq, Dv), (B, H, Lq, Lk) | None
        del q, k, v  # without grad, the projections are freed before the output projection allocates
        out = self.out_proj(merge_heads(out_heads))  # (B, Lq, O)
        if unbatched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        return AttentionOutput(out, weights) if weights is not None else out

    def _rotate_and_cache(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cache: KVCache | None,
        segment_ids: Tensor | tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Rotary positions and the KV cache, between projection and attention.

        New keys rotate by their absolute positions (after the L cached ones) before they are cached;
        queries rotate by bottom-right aligned positions ``Lk - Lq + i``, the rule ``causal`` uses.
        With ``segment_ids`` (no cache) positions restart at 0 in each packed sequence.
        Returns q (B, H, Lq, Dk), k (B, Hkv, Lk, Dk), v (B, Hkv, Lk, Dv) with Lk counting the cache.
        """
        if segment_ids is not None and self.rotary is not None:
            if cache is not None:
                raise ValueError(
                    "rotary=True with both a KV cache and segment_ids is not supported: decode packed "
                    "sequences one row per sequence (positions continue the cache), or drop the cache"
                )
            q_ids, kv_ids = check_segment_ids(segment_ids, q.shape[0], q.shape[2], k.shape[2], q.device)
            q = self.rotary(q, positions=segment_positions(q_ids))  # (B, H, Lq, Dk)
            return q, self.rotary(k, positions=segment_positions(kv_ids)), v  # (B, Hkv, Lk, Dk)
        if cache is not None and cache.static and cache.keys is not None:
            k, v = cache.keys, cache.values  # (B, Hkv, Lk, Dk), (B, Hkv, Lk, Dv), rotated when stored
        else:
            if self.rotary is not None:
                k = self.rotary(k, offset=0 if cache is None else len(cache))  # (B, Hkv, Lnew, Dk)
            if cache is not None:
                k, v = cache.update(k, v)  # (B, Hkv, L + Lnew, Dk), (B, Hkv, L + Lnew, Dv)
        if self.rotary is not None:
            q = self.rotary(q, offset=k.shape[2] - q.shape[2])  # (B, H, Lq, Dk)
        return q, k, v

    def _fixed_cache(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cache: KVCache,
        causal: bool,
        valid_lens: Tensor | None,
        segment_ids: object,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, bool]:
        """A step on a fixed-shape cache: the new keys/values written at positions held on the device,
        attention over the whole storage with the positions each query may see as ``valid_lens``.

        The new tokens sit at positions p_i = P + i (P written before; queries and keys rotate by them);
        with ``causal`` query i sees keys 0..p_i (``valid_lens`` (B, Lq) = p_i + 1), else every key written.
        Returns q (B, H, Lq, Dk), k (B, Hkv, max_len, Dk), v (B, Hkv, max_len, Dv), valid_lens, causal=False.
        """
        if valid_lens is not None or segment_ids is not None:
            raise ValueError(
                "a fixed_shape KVCache masks the positions not yet written through valid_lens itself: "
                "pass mask= (broadcasting to (B, H, Lq, max_len)) for anything more, not valid_lens or "
                "segment_ids"
            )
        b, lq = q.shape[0], q.shape[2]
        if k.shape[2] != lq:
            raise ValueError(
                f"a fixed_shape KVCache serves self-attention steps: the query's {lq} positions are the new "
                f"keys' positions, got {k.shape[2]} new keys"
            )
        at = cache.next_positions(lq, q.device)  # (Lq,) absolute positions of the new tokens
        if self.rotary is not None:
            q = self.rotary(q, positions=at.expand(b, lq))  # (B, H, Lq, Dk)
            k = self.rotary(k, positions=at.expand(b, lq))  # (B, Hkv, Lq, Dk)
        k, v = cache.update(k, v, positions=at)  # (B, Hkv, max_len, Dk), (B, Hkv, max_len, Dv)
        seen = (at + 1) if causal else (at[-1:] + 1).expand(lq)  # (Lq,) keys each query sees
        return q, k, v, seen.expand(b, lq), False

    # ------------------------------------------------------------------------------------------
    # torch.nn.MultiheadAttention interop
    # ------------------------------------------------------------------------------------------

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> MultiHeadAttention:
        """A copy of ``m``'s exact weights (kdim/vdim and bias=False layouts included).

        The result is batch first whatever ``m.batch_first`` is. ``add_bias_kv``/``add_zero_attn`` have
        no place here: use :class:`multihead.compat.torch.MultiheadAttention` for those.
        """
        if not isinstance(m, nn.MultiheadAttention):
            raise TypeError(f"from_torch expects a torch.nn.MultiheadAttention, got {type(m).__name__}")
        if m.bias_k is not None or m.add_zero_attn:
            raise ValueError(
                "add_bias_kv / add_zero_attn are not part of multihead.MultiHeadAttention; load the module "
                "into multihead.compat.torch.MultiheadAttention instead"
            )
        ref = m.out_proj.weight
        new = cls(
            m.embed_dim,
            m.num_heads,
            kdim=m.kdim,
            vdim=m.vdim,
            bias=m.in_proj_bias is not None,
            dropout=m.dropout,
            device=ref.device,
            dtype=ref.dtype,
        )
        new.load_state_dict({k: v for k, v in m.state_dict().items()}, strict=True)
        new.train(m.training)
        return new

    def to_torch(self) -> nn.MultiheadAttention:
        """An ``nn.MultiheadAttention(batch_first=True)`` with these exact weights.

        Only for configurations torch can express: kv_heads == num_heads, head_dim * num_heads ==
        embed_dim, v_head_dim == head_dim and out_dim == embed_dim.
        """
        problems = []
        if self.kv_heads != self.num_heads:
            problems.append(f"kv_heads={self.kv_heads} != num_heads={self.num_heads} (grouped-query)")
        if self.head_dim * self.num_heads != self.embed_dim:
            problems.append(
                f"head_dim*num_heads={self.head_dim * self.num_heads} != embed_dim={self.embed_dim}"
            )
        if self.v_head_dim != self.head_dim:
            problems.append(f"v_head_dim={self.v_head_dim} != head_dim={self.head_dim}")
        if self.out_dim != self.embed_dim:
            problems.append(f"out_dim={self.out_dim} != embed_dim={self.embed_dim}")
        if self.rotary is not None:
            problems.append("rotary=True (torch has no rotary embeddings)")
        if self.softcap is not None:
            problems.append(f"softcap={self.softcap:g} (torch has no logit soft-capping)")
        if self.sinks is not None:
            problems.append("sinks=True (torch has no attention sinks)")
        if problems:
            raise ValueError("torch.nn.MultiheadAttention cannot express this module: " + "; ".join(problems))
        ref = self.out_proj.weight
        m = nn.MultiheadAttention(
            self.embed_dim,
            self.num_heads,
            dropout=self.dropout,
            bias=self.in_proj_bias is not None,
            kdim=self.kdim,
            vdim=self.vdim,
            batch_first=True,
            device=ref.device,
            dtype=ref.dtype,
        )
        m.load_state_dict(self.state_dict(), strict=True)
        m.train(self.training)
        return m
