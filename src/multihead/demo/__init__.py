"""The demo behind ``multihead demo``."""
