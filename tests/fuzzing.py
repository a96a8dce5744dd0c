"""One campaign size for every fuzz target (``tests/test_fuzz*.py``): a few dozen examples in CI, derandomized;
``CKPTFIX_FUZZ_EXAMPLES=20000`` for a longer, random campaign."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("CKPTFIX_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="CKPTFIX_FUZZ_EXAMPLES" not in os.environ,
    suppress_health_check=list(HealthCheck),
    database=None,
)
