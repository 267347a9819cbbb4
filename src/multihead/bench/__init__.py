"""``multihead bench``: interleaved benchmarks against peers, with the machine's matmul as the yardstick."""

from .harness import add_arguments, main, run

__all__ = ["add_arguments", "main", "run"]
