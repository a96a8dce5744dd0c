"""``ckptfix merge --average`` / ``--weights``: the (weighted) mean of checkpoints of one model, streamed.

Expected values are computed here with torch in the order the merge documents (float64, inputs in file order,
divided by the weights' sum, cast back), so tensors compare with torch.equal."""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

import ckptfix
from ckptfix.cli import cli
from ckptfix.errors import AverageError
from ckptfix.merging.files import merge_files
from ckptfix.reading import Opened

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _state(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    state = {f"w_{str(d).removeprefix('torch.')}": torch.randn(4, 5, generator=gen).to(d) for d in DTYPES}
    state["bn.running_var"] = torch.rand(5, generator=gen) + 0.5
    state["bn.num_batches_tracked"] = torch.tensor(100 * step)
    state["mask"] = torch.rand(5, generator=gen) > 0.5
    return state


def _ckpt(step: int) -> dict[str, object]:
    return {"model": _state(step), "step": step, "note": f"step {step}"}


def _expected(states: Sequence[dict[str, torch.Tensor]], weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """The documented arithmetic: sum(w_i * x_i) in float64, in file order, / sum(w); others from the last."""
    out = {}
    for key, last in states[-1].items():
        if last.is_floating_point():
            acc = torch.zeros(last.shape, dtype=torch.float64)
            for state, w in zip(states, weights, strict=True):
                acc += state[key].to(torch.float64) * w
            out[key] = (acc / math.fsum(weights)).to(last.dtype)
        else:
            out[key] = last
    return out


def _files(tmp_path: Path, steps: Sequence[int]) -> list[Path]:
    files = []
    for step in steps:
        files.append(tmp_path / f"step{step}.pt")
        torch.save(_ckpt(step), files[-1])
    return files


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype, key  # dtype kept
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("out_name", ["avg.pt", "avg.safetensors"])
def test_average_is_the_mean_in_each_dtype_with_the_rest_from_the_last_file(tmp_path: Path, out_name: str) -> None:
    files = _files(tmp_path, [1, 2, 3])
    out = tmp_path / out_name
    before = [f.read_bytes() for f in files]
    result = run("merge", *files, "-o", out, "--average")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[:2] == [
        "averaged 3 checkpoint(s) (weights 0.3333, 0.3333, 0.3333; layouts: single)",
        f"floating tensors averaged: 5; other tensors and entries from {files[-1]}",
    ]
    merged = ckptfix.load(out)
    want = _expected([_state(s) for s in (1, 2, 3)], [1.0, 1.0, 1.0])
    _assert_equal(dict(merged["model"]), want)
    assert torch.equal(merged["model"]["bn.num_batches_tracked"], torch.tensor(300))  # the last file's
    if out_name.endswith(".pt"):
        assert (merged["step"], merged["note"]) == (3, "step 3")
    assert [f.read_bytes() for f in files] == before  # inputs untouched
    # a plain mean of two is exactly (a + b) / 2, as timm's avg_checkpoints computes it (float64, then cast)
    two = ckptfix.merge([_ckpt(1), _ckpt(2)], average=True)["model"]
    a, b = _state(1)["w_float32"], _state(2)["w_float32"]
    assert torch.equal(two["w_float32"], ((a.double() + b.double()) / 2).float())


def test_weights_give_the_weighted_mean_in_the_cli_and_the_library(tmp_path: Path) -> None:
    files = _files(tmp_path, [4, 5])
    out = tmp_path / "soup.safetensors"
    result = run("merge", *files, "-o", out, "--weights", "0.3,0.7", "--model-only")
    assert result.exit_code == 0, result.output
    assert "(weights 0.3, 0.7; layouts: single)" in result.stdout
    want = _expected([_state(4), _state(5)], [0.3, 0.7])
    _assert_equal(dict(ckptfix.load(out)), want)
    report = merge_files(files, tmp_path / "soup.pt", weights=[0.3, 0.7])
    assert report.weights == [0.3, 0.7]
    assert sorted(report.averaged) == sorted(k for k, v in want.items() if v.is_floating_point())
    _assert_equal(dict(ckptfix.load(tmp_path / "soup.pt")["model"]), want)
    _assert_equal(dict(ckptfix.merge([_ckpt(4), _ckpt(5)], weights=[0.3, 0.7])["model"]), want)
    # weights are divided by their sum (a negative one is refused: see below)
    scaled = ckptfix.merge([_ckpt(4), _ckpt(5)], weights=[3, 7])["model"]
    torch.testing.assert_close(scaled["w_float64"], want["w_float64"], rtol=1e-15, atol=0)


def test_average_reads_folders_safetensors_and_other_layouts(tmp_path: Path) -> None:
    states = [_state(s) for s in (6, 7, 8)]
    folder = tmp_path / "hf"
    ckptfix.save(states[0], folder / "model.safetensors", shard_size=200)  # a sharded transformers folder
    assert len(list(folder.glob("*.safetensors"))) > 1
    ckptfix.save(states[1], tmp_path / "b.safetensors")
    torch.save({"state_dict": {f"module.{k}": v for k, v in states[2].items()}}, tmp_path / "c.pt")  # DDP layout
    out = tmp_path / "avg.pt"
    result = run("merge", folder, tmp_path / "b.safetensors", tmp_path / "c.pt", "-o", out, "--average")
    assert result.exit_code == 0, result.output
    _assert_equal(dict(ckptfix.load(out)["state_dict"]), _expected(states, [1.0, 1.0, 1.0]))


def test_average_reads_one_tensor_of_one_file_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = []
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        files.append(tmp_path / f"s{step}.pt")
        torch.save({f"layer{i}.weight": torch.randn(64, 64, generator=gen) for i in range(8)}, files[-1])
    alive: set[int] = set()
    peak, reads = [0], [0]
    read = Opened.raw  # a tensor's bytes (torch only where it must read it)

    def counted(self: Opened, value: object) -> object:
        tensor = read(self, value)
        reads[0] += 1
        alive.add(reads[0])
        weakref.finalize(tensor, alive.discard, reads[0])
        peak[0] = max(peak[0], len(alive))
        return tensor

    monkeypatch.setattr(Opened, "raw", counted)
    merge_files(files, tmp_path / "avg.safetensors", average=True)
    assert reads[0] == 3 * 8  # each tensor of each file read once
    assert peak[0] == 1  # never two read tensors alive at once: memory holds one tensor and the float64 sum


def test_refusals_are_one_line_exit_2_and_write_nothing(tmp_path: Path) -> None:
    files = _files(tmp_path, [1, 2])
    out = tmp_path / "avg.pt"
    other = _ckpt(3)
    other["model"]["extra.bias"] = torch.zeros(5)  # type: ignore[index]
    torch.save(other, tmp_path / "more_keys.pt")
    wide = _ckpt(3)
    wide["model"]["w_float32"] = torch.zeros(4, 6)  # type: ignore[index]
    torch.save(wide, tmp_path / "wide.pt")
    before = sorted(tmp_path.iterdir())
    cases = [
        ((files[0], tmp_path / "more_keys.pt", "--average"),
         f"{files[0]}['model']: keys differ from {tmp_path / 'more_keys.pt'}['model'] (1 only there, 0 only here; "
         f"'extra.bias' only in {tmp_path / 'more_keys.pt'}['model']); checkpoints of one model hold the same keys"),
        ((files[0], tmp_path / "wide.pt", "--average"),
         f"{files[0]}['model']: 'w_float32' is [4, 5] torch.float32 but [4, 6] torch.float32 in "
         f"{tmp_path / 'wide.pt'}['model']; checkpoints of one model hold the same shapes and dtypes"),
        ((*files, "--weights", "1"), "weights: 1 weight(s) for 2 input(s); give one weight per input, in order"),
        ((*files, "--weights", "1,nan"), "weights: nan is not a finite number; give one finite weight per input"),
        ((*files, "--weights", "1,-1"), "weights: -1 is negative; give weights of zero or more, at least one of them "),
        ((*files, "--average", "--buffers", "mean"), "buffers applies to merging ranks, not to averaging"),
    ]  # fmt: skip
    for args, message in cases:
        result = run("merge", *args, "-o", out)
        assert result.exit_code == 2, (args, result.output)
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"ckptfix: error: {message}"), lines
        assert "Traceback" not in result.output
    result = run("merge", *files, "-o", out, "--weights", "a,b")
    assert result.exit_code == 2 and "'a,b' is not a list of numbers" in result.output
    assert sorted(tmp_path.iterdir()) == before  # nothing written, no temp file left
    with pytest.raises(AverageError, match="1 weight"):
        ckptfix.merge([_ckpt(1), _ckpt(2)], weights=[1.0])


def test_fp8_tensors_are_refused_rather_than_averaged_without_their_scales(tmp_path: Path) -> None:
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    states = [{"w": torch.ones(4).to(torch.float8_e4m3fn), "w_scale": torch.tensor(float(s))} for s in (1, 2)]
    with pytest.raises(AverageError, match=r"'w' is torch.float8_e4m3fn, whose values need their scales"):
        ckptfix.merge(states, average=True)


@pytest.mark.skipif(not (FIXTURES / "ddp_rank1.pt").exists(), reason="trainer fixtures not generated")
def test_average_of_the_trainer_checkpoints_loads_into_the_model(tmp_path: Path) -> None:
    from ckptfix.trainer.model import build_model

    files = [FIXTURES / "ddp_rank0.pt", FIXTURES / "ddp_rank1.pt"]
    out = tmp_path / "avg.pt"
    result = run("merge", *files, "-o", out, "--average")
    assert result.exit_code == 0, result.output
    ckpts = [torch.load(f, weights_only=True) for f in files]
    states = [{k.removeprefix("module."): v for k, v in c["model"].items()} for c in ckpts]
    want = _expected(states, [1.0, 1.0])
    merged = ckptfix.load(out)
    _assert_equal(dict(merged["model"]), want)
    assert merged["rank"] == ckpts[1]["rank"] == 1  # the other entries: the last file's
    bn = next(k for k in want if k.endswith("running_mean"))
    assert not torch.equal(states[0][bn], states[1][bn])  # the ranks' statistics differ: this is a real mean
    model, reference = build_model(), build_model()
    assert ckptfix.load_into(model, out).loads_as_is
    reference.load_state_dict(want)
    probe = torch.randn(3, 1, 12, 12, generator=torch.Generator().manual_seed(0))
    model.eval(), reference.eval()
    with torch.no_grad():
        assert torch.equal(model(probe), reference(probe))
        assert not torch.equal(model(probe), _loaded(states[0])(probe))  # not simply rank 0's model


def _loaded(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    from ckptfix.trainer.model import build_model

    model = build_model()
    model.load_state_dict(state)
    return model.eval()


def test_weights_are_normalised_before_they_multiply(tmp_path: Path) -> None:
    """Weights at the ends of float64 (subnormal, near the maximum) give the mean, not 0.0, inf or an error."""
    files = [tmp_path / "a.pt", tmp_path / "b.pt"]
    torch.save({"w": torch.tensor([1e-5], dtype=torch.float64)}, files[0])
    torch.save({"w": torch.tensor([3e-5], dtype=torch.float64)}, files[1])
    plain = tmp_path / "plain.pt"
    assert run("merge", *files, "-o", plain, "--average").exit_code == 0
    want = ckptfix.load(plain)["w"]
    torch.testing.assert_close(want, torch.tensor([2e-5], dtype=torch.float64), rtol=1e-15, atol=0)
    for weights, expected in [
        ("5e-324,5e-324", want),
        ("1e308,1e308", want),
        ("1e308,1", torch.tensor([1e-5], dtype=torch.float64)),
    ]:
        out = tmp_path / f"w{weights}.pt"
        result = run("merge", *files, "-o", out, "--weights", weights)
        assert result.exit_code == 0, (weights, result.output)
        got = ckptfix.load(out)["w"]
        assert torch.isfinite(got).all(), weights
        torch.testing.assert_close(got, expected.to(got.dtype), rtol=1e-15, atol=0)
        if expected is want:
            assert torch.equal(got, want), weights  # equal weights, however small or large: the plain mean
    assert merge_files(files, tmp_path / "r.pt", weights=[5e-324, 5e-324]).weights == [0.5, 0.5]
    merged = ckptfix.merge([{"w": torch.tensor([1e-5])}, {"w": torch.tensor([3e-5])}], weights=[1e308, 1e308])
    assert torch.equal(merged["w"], ((torch.tensor([1e-5]).double() + torch.tensor([3e-5]).double()) / 2).float())


def test_weights_that_cannot_be_normalised_are_refused_naming_the_option(tmp_path: Path) -> None:
    files = _files(tmp_path, [1, 2])
    out = tmp_path / "avg.pt"
    before = sorted(tmp_path.iterdir())
    some = "give weights of zero or more, at least one of them above zero (each is divided by their sum)"
    cases = [
        ("1,inf", "weights: inf is not a finite number; give one finite weight per input"),
        ("-inf,1", "weights: -inf is not a finite number; give one finite weight per input"),
        ("1,-1", f"weights: -1 is negative; {some}"),
        ("-0.5,1.5", f"weights: -0.5 is negative; {some}"),
        ("0,0", f"weights: all are zero; {some}"),
    ]
    for weights, message in cases:
        result = run("merge", *files, "-o", out, "--weights", weights)
        assert result.exit_code == 2, (weights, result.output)
        assert result.stderr.splitlines() == [f"ckptfix: error: {message}"], weights
    assert sorted(tmp_path.iterdir()) == before
    with pytest.raises(AverageError, match="weights: all are zero"):
        ckptfix.merge([_ckpt(1), _ckpt(2)], weights=[0.0, -0.0])
