"""Exact ring attention over ``torch.distributed``: one sequence split across processes and machines.

Dimensions: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), G = H // Hkv, P ranks in the
process group, r this rank, L a total (global) sequence length, Lq/Lk this rank's local query/key lengths,
n/m the query rows/key columns one block step works on, Dk query/key head dim, Dv value head dim.

Each rank holds a shard of the queries and of the keys/values. The key/value shards travel once around
the ring of ranks (rank r sends to r + 1 and receives from r - 1) with point-to-point ``isend``/``irecv``;
while the next shard is in flight, the rank attends its queries to the shard it has. Each step gives a
partial, unnormalised output with its row max and row sum of exponentials (the log-sum-exp, in two
parts); rescaling the partial results to a common max and adding them is exact: the result equals
softmax attention over the whole sequence. The backward pass sends the key/value shards around again, together with the gradients of K and V, which collect every rank's
contribution on the way and end on the rank that owns the shard.

Which positions of the sequence a rank holds is its *layout* (:data:`LAYOUTS`), the same one
:func:`shard` cuts with. For L = 8 tokens over P = 2 ranks::

    contiguous  rank 0: 0 1 2 3    rank 1: 4 5 6 7      (one block each)
    zigzag      rank 0: 0 1 6 7    rank 1: 2 3 4 5      (chunks r and 2P-1-r of 2P chunks)
    striped     rank 0: 0 2 4 6    rank 1: 1 3 5 7      (every P-th token)

With ``causal=True`` a contiguous layout leaves rank 0 almost idle (its queries see only its own keys)
while rank P-1 attends to everything; zigzag gives every rank the same amount of work, and the steps
skip the key blocks (or the query rows) that the causal mask hides entirely.
"""

from .ring import (
    LAYOUTS,
    ShardedAttention,
    causal_work,
    gather_sequence,
    launch,
    ring_attention,
    shard,
    sharded_attention,
    unshard,
    use_process_group,
)

__all__ = [
    "LAYOUTS",
    "ShardedAttention",
    "causal_work",
    "gather_sequence",
    "launch",
    "ring_attention",
    "shard",
    "sharded_attention",
    "unshard",
    "use_process_group",
]
