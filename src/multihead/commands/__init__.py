"""Commands on a Hugging Face checkpoint folder: ``multihead view`` (an offline HTML page of every head) and
``multihead prune`` (score, prune and recover heads, then save a folder that loads back)."""
