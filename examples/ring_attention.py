"""Ring attention: one causal sequence split over several processes, checked against one process.

On one machine (spawns the processes itself, gloo on CPU)::

    python examples/ring_attention.py --world 4 --seq-len 4096

On several machines (or GPUs: NCCL is used when CUDA is available), start it with torchrun on every
node; the script then joins the group torchrun set up instead of spawning::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/ring_attention.py --torchrun --seq-len 131072

Every rank holds ``seq_len / world`` tokens (zigzag layout, so causal work is balanced). The full
sequence is also run on each rank here, only to show the answers agree; drop that on real lengths.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import multihead as mh
from multihead import distributed as mhd


def demo(seq_len: int, layout: str, check: bool) -> dict:
    """Runs in every rank of an initialised process group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())  # set by launch / main below
    torch.manual_seed(0)  # the same weights and the same input on every rank
    mha = mh.MultiHeadAttention(64, 8, kv_heads=2, device=device)
    x = torch.randn(2, seq_len, 64, device=device)  # (B, L, E), the whole sequence
    target = torch.randn(2, seq_len, 64, device=device)

    mhd.use_process_group(mha, dist.group.WORLD, layout=layout)
    x_local = mhd.shard(x, 1, rank, world, layout)  # (B, L_r, E): this rank's tokens
    t0 = time.perf_counter()
    y_local = mha(x_local, causal=True)  # (B, L_r, E)
    loss = (y_local - mhd.shard(target, 1, rank, world, layout)).square().sum() / target.numel()
    loss.backward()  # dK/dV travel back around the ring
    for p in mha.parameters():  # parameters are replicated: sum their gradients over the ranks
        dist.all_reduce(p.grad)
    seconds = time.perf_counter() - t0
    report = {"rank": rank, "tokens": x_local.shape[1], "seconds": seconds}

    if check:  # the single-process answer, for comparison only
        y = mhd.gather_sequence(y_local.detach(), 1, layout=layout)  # (B, L, E)
        grads = [p.grad.clone() for p in mha.parameters()]
        mhd.use_process_group(mha, None)
        mha.zero_grad()
        y_ref = mha(x, causal=True)
        ((y_ref - target).square().sum() / target.numel()).backward()
        report["max_abs_err_output"] = float((y - y_ref.detach()).abs().max())
        report["max_abs_err_grads"] = max(
            float((g - p.grad).abs().max()) for g, p in zip(grads, mha.parameters())
        )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2, help="processes to spawn on this machine")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--layout", default="zigzag", choices=mhd.LAYOUTS)
    parser.add_argument("--no-check", action="store_true", help="skip the single-process comparison")
    parser.add_argument("--torchrun", action="store_true", help="join the group torchrun started")
    args = parser.parse_args()
    job = (args.seq_len, args.layout, not args.no_check)
    if args.torchrun:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, demo(*job))
        dist.destroy_process_group()
        if int(os.environ.get("RANK", 0)) != 0:
            return
    else:
        backend = "nccl" if torch.cuda.device_count() >= args.world else "gloo"
        reports = mhd.launch(demo, args.world, job, backend=backend, timeout=600)
    for r in reports:
        print(", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
