"""``python -m multihead`` is the ``multihead`` command."""

from .cli import main

raise SystemExit(main())
