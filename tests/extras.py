"""Why a test skips without an optional library: which one, and the command that installs it (as .ci/run does).

pytest's ``-ra`` summary, on by default, lists each reason with how many tests it skipped.
"""

FRAMEWORKS = "pip install -e '.[frameworks]'"
DEEPSPEED = "pip install wheel && DS_BUILD_OPS=0 pip install --no-build-isolation -e '.[deepspeed]'"
# Not installable beside this venv's torch: each runs in a venv of its own, made as docs/formats.md shows.
MEGATRON_VENV = "a venv of its own with megatron-core (docs/formats.md#megatron-core-torch_dist-folders)"
TITAN_VENV = (
    "a venv of its own with torchtune and torchtitan (docs/formats.md#torchtune-and-torchtitan-llama-checkpoints)"
)


def needs(library: str, install: str = FRAMEWORKS) -> str:
    """The skip reason for a test that needs ``library``: ``needs transformers: pip install -e '.[frameworks]'``."""
    return f"needs {library}, not installed: {install}"
