"""Every parallel layout of the Megatron-Core fixtures (``tests/megatron_runs.py``'s ``RUNS``), the plain one (TP 1,
PP 1 on one rank) and tensor and pipeline parallelism together (TP 2 x PP 2 on four ranks) among them: ``inspect``
says each run's layout, rank count, arguments and tensor count as the generator recorded them, without reading a
tensor byte. (Each run's exact conversion: ``test_megatron.py``, parametrised over the same runs.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from safetensors import safe_open

from ckptfix.cli import cli
from tests.megatron_runs import FIXTURES, fixture_runs

MADE = fixture_runs()
RUNS = sorted(MADE)


def run(*args: Any) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_the_plain_layout_and_tp_by_pp_on_four_ranks_are_among_the_runs() -> None:
    runs = MADE.values()
    plain = [r for r in runs if (r["tp"], r["pp"], r["ep"], r.get("vpp")) == (1, 1, 1, None)]
    assert plain and all(r["world_size"] == 1 for r in plain)
    both = [r for r in runs if r["tp"] == 2 and r["pp"] == 2]
    assert both and all(r["world_size"] == 4 for r in both)
    # tied output, the Adam state, virtual stages and EP: each still covered
    assert any(r["tied"] for r in runs) and any(r.get("adam") for r in runs)
    assert any(r.get("vpp") for r in runs) and any(r["ep"] == 2 and r["moe"] for r in runs)
    for dtype in ("fp32", "bf16"):
        assert {(r["tp"], r["pp"]) for r in runs if r["dtype"] == dtype} >= {(2, 1)}
    assert {(r["tp"], r["pp"]) for r in runs} >= {(1, 1), (2, 1), (1, 2), (2, 2)}


@pytest.mark.parametrize("name", RUNS)
def test_inspect_says_each_runs_layout_without_reading_tensor_bytes(name: str, tmp_path: Path) -> None:
    made = MADE[name]
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    for data in folder.glob("*.distcp"):  # zeroed: no byte of them may be needed to describe the folder
        data.write_bytes(bytes(data.stat().st_size))
    result = run("inspect", "--json", folder)
    assert result.exit_code == 0, result.output
    mg = json.loads(result.output)["megatron"]
    layout = {"tensor": made["tp"], "pipeline": made["pp"], "expert": made["ep"]}
    if "vpp" in made:
        layout["virtual_pipeline"] = made["vpp"]
    assert mg["layout"] == layout and mg["ranks"] == made["world_size"]
    assert mg["args"]["num_layers"] == made["layers"]
    assert mg["args"]["params_dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[made["dtype"]]
    with safe_open(str(FIXTURES / f"{name}.expected.safetensors"), "pt") as f:
        assert mg["tensors"] == len(list(f.keys()))
    text = run("inspect", folder)
    assert text.exit_code == 0, text.output
    said = f"tensor parallel {made['tp']}, pipeline parallel {made['pp']}"
    ranks = f"written by {made['world_size']} rank{'s' * (made['world_size'] != 1)}, iteration {made['steps']}"
    assert said in text.output and ranks in text.output, text.output
