"""Exact context parallelism over ``torch.distributed``: one sequence split across processes and machines.

Dimensions: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), P ranks in the process group,
L a total (global) sequence length, Lq/Lk this rank's local query/key lengths, Dk/Dv head dims.

Each rank holds a shard of the queries and of the keys/values. The key/value shards travel once around
the ring of ranks (rank r sends to r + 1 and receives from r - 1); while the next shard is in flight,
the rank attends its queries to the shard it has and merges the block's normalised output and
log-sum-exp into its running answer, which is exact: the result equals softmax attention over the whole
sequence. The backward pass sends the shards around again with their dK/dV accumulators. Ulysses
instead turns sequence shards into head shards with one all-to-all and back with another; hybrid runs
Ulysses inside groups of ranks and the ring across them.

The package, top to bottom:

* :mod:`.sharding` -- layouts (which global positions a rank holds), :func:`shard`, :func:`unshard`,
  :func:`gather_sequence`, the causal region of a block and :func:`causal_work`;
* :mod:`.blocks` -- one block step, forward and backward, on PyTorch's fused CPU flash kernel or
  plain matmuls;
* :mod:`.agree` -- what every rank agrees on before a call (shapes, lengths, layout, strategy): one
  error on every rank, never a hang; a rank that does not answer raises :class:`PeerLost`;
* :mod:`.ring` -- the ring forward/backward (K/V streamed in pieces) and :func:`ring_attention`;
* :mod:`.exchange` -- the head split and Ulysses' all-to-alls, a chunk of heads at a time;
* :mod:`.ulysses` -- :func:`ulysses_attention` over those exchanges;
* :mod:`.hybrid` -- Ulysses x ring (:func:`hybrid_attention`, :class:`HybridGroups`);
* :mod:`.modules` -- :class:`RingAttention`, :class:`UlyssesAttention`, :class:`HybridAttention`: the
  ``attention_fn`` that modules call through :mod:`multihead.nn.seam`; :func:`use_process_group`;
* :mod:`.context` -- :func:`context_parallel` (every attention of a model, for a block) and
  :func:`shard_batch`;
* :mod:`.planner` -- :func:`plan`: memory, bytes and time of each strategy on machines you do not have;
* :mod:`.launch` -- :func:`launch`, several local processes sharing one group.

Layouts, for L = 8 tokens over P = 2 ranks::

    contiguous  rank 0: 0 1 2 3    rank 1: 4 5 6 7      (one block each)
    zigzag      rank 0: 0 1 6 7    rank 1: 2 3 4 5      (chunks r and 2P-1-r of 2P chunks)
    striped     rank 0: 0 2 4 6    rank 1: 1 3 5 7      (every P-th token)

With ``causal=True`` a contiguous layout leaves rank 0 almost idle (its queries see only its own keys)
while rank P-1 attends to everything; zigzag gives every rank the same amount of work, and the steps
skip the key blocks (or the query rows) that the causal mask hides entirely.
"""

from .agree import STRATEGIES, PeerLost
from .context import ContextParallel, context_parallel, shard_batch
from .hybrid import HybridGroups, hybrid_attention
from .launch import launch
from .modules import (
    HybridAttention,
    RingAttention,
    ShardedAttention,
    UlyssesAttention,
    sharded_attention,
    use_process_group,
)
from .planner import PRESETS, Estimate, Machine, plan
from .ring import ring_attention
from .sharding import LAYOUTS, causal_work, gather_sequence, shard, unshard
from .ulysses import head_split, ulysses_attention

__all__ = [
    "LAYOUTS",
    "PRESETS",
    "Estimate",
    "Machine",
    "STRATEGIES",
    "PeerLost",
    "ContextParallel",
    "HybridAttention",
    "HybridGroups",
    "RingAttention",
    "ShardedAttention",
    "UlyssesAttention",
    "causal_work",
    "context_parallel",
    "gather_sequence",
    "head_split",
    "hybrid_attention",
    "launch",
    "plan",
    "ring_attention",
    "shard",
    "shard_batch",
    "sharded_attention",
    "unshard",
    "ulysses_attention",
    "use_process_group",
]
