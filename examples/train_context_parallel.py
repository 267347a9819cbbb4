"""Train a small Llama-style model with context parallelism: each rank holds 1/P of every sequence.

On one machine, CPU (spawns the ranks itself, gloo)::

    python examples/train_context_parallel.py --world 4 --steps 20 --seq-len 2048

With torchrun (the same code: NCCL when CUDA is available, gloo otherwise), on one or several nodes::

    torchrun --nproc-per-node 4 examples/train_context_parallel.py --steps 20 --seq-len 8192
    torchrun --nproc-per-node 4 examples/train_context_parallel.py --save runs/ckpt --steps 20
    torchrun --nproc-per-node 4 examples/train_context_parallel.py --resume runs/ckpt/step-20 --steps 40

The model is a Hugging Face ``LlamaForCausalLM`` built from a config (random weights, no download) and
run on ``attn_implementation="multihead"``. The data is one long packed byte stream of local text (the
Python standard library's sources): documents follow each other, their positions restart at 0, and no
token is padding. Each step cuts ``--batch`` windows of ``--seq-len`` bytes from the stream; inside
``multihead.distributed.context_parallel`` every rank feeds the model its shard of each window
(``cp.shard``: its tokens, their global positions, the labels shifted once over the whole window), the
per-rank loss is its token-loss sum over the global token count, and the parameter gradients are summed
over the ranks: the losses and the updates are those of one process (the test holds them to 1e-4).
It prints the loss and tokens/s with a progress bar and saves a ``torch.distributed.checkpoint`` to
``--save``/step-N (every ``--save-every`` steps and at the end); ``--resume`` continues from one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from multihead import distributed as mhd
from multihead.progress import Progress


def text_stream(limit: int = 4_000_000) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) byte tokens of the standard library's sources, one file after another, and (N,) positions
    that restart at 0 at each file: a packed stream without padding (same on every rank)."""
    tokens, positions, total = [], [], 0
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
        tokens.append(data)
        positions.append(torch.arange(len(data)))
        total += len(data)
        if total >= limit:
            break
    return torch.cat(tokens), torch.cat(positions)


def window_batch(stream: tuple[torch.Tensor, torch.Tensor], step: int, batch: int, seq_len: int) -> dict:
    """The full (B, L) batch of ``step``: input_ids, position_ids and labels (the same on every rank)."""
    tokens, positions = stream
    starts = [((step * batch + b) * seq_len * 7919) % (len(tokens) - seq_len) for b in range(batch)]
    ids = torch.stack([tokens[s : s + seq_len] for s in starts])  # (B, L)
    pos = torch.stack([positions[s : s + seq_len] for s in starts])  # (B, L), restarting at documents
    return {"input_ids": ids, "position_ids": pos, "labels": ids.clone()}


def build(args: argparse.Namespace, device: torch.device) -> tuple[Any, torch.optim.Optimizer]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from multihead.integrations import transformers as mhtf

    torch.manual_seed(args.seed)  # the same weights on every rank
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq_len, 4096),
        use_cache=False,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation=mhtf.register()).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def train(args: argparse.Namespace) -> list[float]:
    """Runs on every rank of an initialised process group; returns the loss of each step (every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    model, optim = build(args, device)
    first = 0
    if args.resume:
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd, "step": 0}
        dcp.load(state, checkpoint_id=args.resume)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        first = int(state["step"])
    stream = text_stream(args.text)
    losses = []
    tokens = args.batch * args.seq_len
    with (
        mhd.context_parallel(model, strategy=args.strategy, layout=args.layout) as cp,
        Progress(args.steps - first, f"train x{world}", enabled=rank == 0) as bar,
    ):
        for step in range(first, args.steps):
            t0 = time.perf_counter()
            batch = {k: v.to(device) for k, v in window_batch(stream, step, args.batch, args.seq_len).items()}
            out = model(**cp.shard(batch))  # this rank's tokens; loss = its token-loss sum / global count
            out.loss.backward()
            for p in model.parameters():  # context_parallel changes attention only: reduce the grads here
                dist.all_reduce(p.grad)
            optim.step()
            optim.zero_grad(set_to_none=False)
            loss = out.loss.detach().clone()
            dist.all_reduce(loss)  # the single-process loss
            losses.append(float(loss))
            bar.update(1, loss=f"{losses[-1]:.4f}", tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
            if args.save and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
                model_sd, optim_sd = get_state_dict(model, optim)
                state = {"model": model_sd, "optim": optim_sd, "step": step + 1}
                folder = Path(args.save) / f"step-{step + 1}"
                dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, overwrite=True))
    return losses


def _torchrun(args: argparse.Namespace) -> list[float]:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        return train(args)
    finally:
        dist.destroy_process_group()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2, help="ranks to start here (without torchrun)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--strategy", default="ring", choices=mhd.STRATEGIES)
    parser.add_argument("--layout", default="zigzag", choices=mhd.LAYOUTS)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--text", type=int, default=4_000_000, help="bytes of text in the stream")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--save", default="", help="checkpoints go to SAVE/step-N (torch.distributed.checkpoint)"
    )
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--resume", default="", help="checkpoint to continue from (a SAVE/step-N folder)")
    parser.add_argument("--log", default="", help="write the losses as JSON here (rank 0)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[float]:
    """Train; returns rank 0's losses (also written to ``--log``)."""
    args = parse(argv)
    if "RANK" in os.environ:  # started by torchrun
        losses = _torchrun(args)
        if int(os.environ["RANK"]) != 0:
            return losses
    else:
        losses = mhd.launch(train, args.world, (args,), timeout=3600, start_method="fork")[0]
    if args.log:
        Path(args.log).write_text(json.dumps({"losses": losses, "world": args.world}))
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
