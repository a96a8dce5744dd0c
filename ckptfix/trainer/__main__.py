"""``python -m ckptfix.trainer`` and ``torchrun --nproc-per-node N -m ckptfix.trainer``."""

from ckptfix.trainer.loop import main

raise SystemExit(main())
