"""ckptfix.torchcompat: what differs between torch releases and installs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent

# numpy made unimportable, as in a venv with only the CPU torch wheel (which does not bring numpy)
_WITHOUT_NUMPY = "import sys; sys.modules['numpy'] = None; sys.argv = ['ckptfix', *sys.argv[1:]]; "


def test_commands_do_not_print_torchs_numpy_warning_where_numpy_is_missing(tmp_path: Path) -> None:
    def run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", _WITHOUT_NUMPY + code, *args], capture_output=True, text=True, cwd=ROOT, timeout=120
        )

    control = run("import torch")
    assert "Failed to initialize NumPy" in control.stderr  # torch itself warns: the test sees a real numpy-less run
    fixture = str(ROOT / "fixtures" / "ddp_wrapped.pt")
    for args in (["inspect", fixture], ["convert", fixture, str(tmp_path / "plain.safetensors"), "--model-only"]):
        done = run("from ckptfix.cli import main; main()", *args)
        assert done.returncode == 0, done.stderr
        assert "NumPy" not in done.stderr, (args, done.stderr)
    child = run("from ckptfix.torchcompat import without_numpy_warning; without_numpy_warning(); "
                "import subprocess; subprocess.run([sys.executable, '-c', "
                "\"import sys; sys.modules['numpy'] = None; import torch\"], check=True)")  # fmt: skip
    assert child.returncode == 0 and "NumPy" not in child.stderr, child.stderr  # torchrun workers inherit it
