"""``python -m ckptfix`` is the ``ckptfix`` command."""

from ckptfix.cli import main

main()
