"""Checkpoint folders for the checkpoint commands' tests (``multihead view``, ``multihead prune``).

Tiny random models written with ``save_pretrained`` beside a small word-level tokenizer built here with
the ``tokenizers`` library (no hub download), and the real all-MiniLM-L6-v2 folder
(:func:`multihead.testing.minilm_dir`). Each builder writes into the folder it is given and returns it.
"""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = tuple(
    (
        "the a cat dog sat on mat rug and ran to from house garden big small red blue one two three is was "
        "it he she they we saw looked at quickly slowly today yesterday . , ! ?"
    ).split()
)
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>", "<mask>")  # ids 0..4
VOCAB = len(SPECIALS) + len(WORDS)


def tokenizer():
    """A word-level fast tokenizer over :data:`WORDS` (lower-cased, split on spaces and punctuation) that
    wraps each text as ``<s> ... </s>``; unknown words map to ``<unk>``."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        mask_token="<mask>",
        model_max_length=64,
    )


def _save(model, folder: Path) -> Path:
    folder = Path(folder)
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def llama_folder(folder: str | Path, *, seed: int = 0) -> Path:
    """A tiny ``LlamaForCausalLM`` (2 layers, 4 query heads over 2 key/value heads, 64 positions)."""
    import transformers as T

    torch.manual_seed(seed)
    config = T.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _save(T.LlamaForCausalLM(config).eval(), folder)


def gpt2_folder(folder: str | Path, *, seed: int = 0) -> Path:
    """A tiny ``GPT2LMHeadModel`` (2 layers, 4 heads, 64 positions)."""
    import transformers as T

    torch.manual_seed(seed)
    config = T.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2
    )
    return _save(T.GPT2LMHeadModel(config).eval(), folder)


def bart_folder(folder: str | Path, *, seed: int = 0) -> Path:
    """A tiny ``BartForConditionalGeneration`` (2 + 2 layers, 4 heads, 64 positions)."""
    import transformers as T

    torch.manual_seed(seed)
    config = T.BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    return _save(T.BartForConditionalGeneration(config).eval(), folder)


def bert_mlm_folder(folder: str | Path, *, seed: int = 0) -> Path:
    """A tiny ``BertForMaskedLM`` (2 layers, 4 heads, 64 positions)."""
    import transformers as T

    torch.manual_seed(seed)
    config = T.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return _save(T.BertForMaskedLM(config).eval(), folder)
