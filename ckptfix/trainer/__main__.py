"""``python -m ckptfix.trainer`` and ``torchrun --nproc-per-node N -m ckptfix.trainer``."""

from ckptfix.torchcompat import without_numpy_warning

without_numpy_warning()  # before the trainer imports torch

from ckptfix.trainer.loop import main  # noqa: E402

raise SystemExit(main())
