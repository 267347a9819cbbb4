"""``multihead prune``: choose the heads of a checkpoint the refit can make up for on your text, prune them,
refit, reconstruct, recover, measure, save.

Dimensions: B batch, L tokens, E hidden width, V vocabulary, N texts, P = N (N - 1) / 2 pairs.

:func:`run` does, in order (every check before any work, nothing written on a usage error):

1. load the folder on multihead (:func:`multihead.commands.model_dir.load`), read the text (one per line)
   and split it by a fixed rule (:func:`split_texts`): 20% held out (measured only: the quality the report
   states), 10% validation (chooses between stages and stops recovery), the rest to work on; fewer than
   :data:`MIN_TEXTS` texts is a usage error, fewer than :data:`FEW_TEXTS` a warning;
2. pick the checkpoint's objective (:data:`OBJECTIVES`: one class per kind, :mod:`.objectives`) and choose
   the heads the refit can best make up for: greedily, across layers, the head whose removal leaves the
   least of its layer's output (relative to that output's spread) outside what a least-squares map of
   the kept heads reproduces on texts the map was not fit on (:data:`FOLDS`-fold cross-validation,
   :class:`CrossValidated`; :func:`choose_compensable`, :mod:`.choose`; no layer is ever emptied); with
   ``--quality Q`` instead of ``--heads``: as many of them, in that order, as keep the share ``Q`` of the
   original's validation quality after the refit (a binary search, :mod:`.floor`);
3. refit, layer by layer (each on the inputs the refits before it give), each pruned layer's output
   projection by least squares so that the kept heads reproduce the original layer's output, then
   (BERT-family encoders) that layer's feed-forward output projection, ridge-pulled toward its own weights,
   so that the layer's residual sum matches the original's; on the training tokens plus those of two
   random crops of each text (:func:`refit_layers`, :func:`crops`, :mod:`.refit`);
4. reconstruct, layer by layer: each pruned layer's attention parameters trained by gradient so that the
   layer, on the pruned model's own input, gives the original layer's output, stopped early on the
   validation texts (:func:`reconstruct_layers`, :mod:`.reconstruct`);
5. recover: distil toward the original (:mod:`.recover`), stopped early on the validation texts, and when
   no step improved them, tried again from the weights it started from at a lower learning rate
   (:data:`RECOVERY_LRS`; :data:`FEW_PRUNED_LRS` alone when fewer than half the heads go,
   :func:`recovery_lrs`);
6. measure each stage on the validation and held-out texts (a stage is kept only if it improves the
   validation quality), the parameters, and the forward speed of the original against the pruned model in
   interleaved rounds (:mod:`multihead.bench.pair`);
7. save the weights (safetensors), config (with ``multihead_heads``), tokenizer and the checkpoint's other
   files, and ``prune_report.json`` / ``prune_report.md`` (:mod:`.report`).
"""

from .choose import (
    FOLDS,
    CrossValidated,
    check_prunable,
    choose_and_prune,
    choose_compensable,
    compensable_heads,
    compensable_order,
    gqa_groups,
    grouped,
    removal_order,
)
from .command import STAGES, Job, Stages, options_from, prepare, run
from .floor import Floor, search
from .inputs import (
    DEFAULT_RECONSTRUCT,
    DEFAULT_RECOVER,
    DEFAULT_RECOVER_RECONSTRUCTED,
    FEW_PRUNED_LRS,
    FEW_TEXTS,
    MIN_TEXTS,
    RECOVERY_LRS,
    Options,
    PruneError,
    Splits,
    check_amount,
    encode,
    heads_to_prune,
    most_heads,
    parse_heads,
    parse_quality,
    read_texts,
    reconstruct_steps,
    recover_steps,
    recovery_lrs,
    size_scale,
    split_texts,
)
from .objectives import (
    OBJECTIVES,
    Batch,
    CausalLM,
    Embedding,
    MaskedLM,
    Objective,
    Seq2Seq,
    contrastive_loss,
    crops,
    embed,
    make_batches,
    pair_similarities,
    spearman,
)
from .reconstruct import layer_of, reconstruct_layers
from .recover import Recovery, recover
from .refit import (
    LeastSquares,
    feed_forward_sums,
    output_fits,
    output_folds,
    output_projection,
    refit,
    refit_feed_forward,
    refit_layers,
)
from .report import markdown

__all__ = [
    "DEFAULT_RECONSTRUCT",
    "DEFAULT_RECOVER",
    "DEFAULT_RECOVER_RECONSTRUCTED",
    "FEW_TEXTS",
    "FOLDS",
    "MIN_TEXTS",
    "OBJECTIVES",
    "Batch",
    "CrossValidated",
    "CausalLM",
    "Embedding",
    "Floor",
    "Job",
    "LeastSquares",
    "MaskedLM",
    "Objective",
    "Options",
    "PruneError",
    "FEW_PRUNED_LRS",
    "RECOVERY_LRS",
    "Recovery",
    "STAGES",
    "Seq2Seq",
    "Splits",
    "Stages",
    "check_amount",
    "check_prunable",
    "choose_and_prune",
    "choose_compensable",
    "compensable_heads",
    "compensable_order",
    "contrastive_loss",
    "crops",
    "embed",
    "encode",
    "feed_forward_sums",
    "gqa_groups",
    "grouped",
    "heads_to_prune",
    "layer_of",
    "make_batches",
    "most_heads",
    "markdown",
    "options_from",
    "output_fits",
    "output_folds",
    "output_projection",
    "pair_similarities",
    "parse_heads",
    "parse_quality",
    "prepare",
    "read_texts",
    "reconstruct_layers",
    "reconstruct_steps",
    "recover_steps",
    "recovery_lrs",
    "recover",
    "refit",
    "refit_feed_forward",
    "refit_layers",
    "removal_order",
    "run",
    "search",
    "size_scale",
    "spearman",
    "split_texts",
]
