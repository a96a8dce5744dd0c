from __future__ import annotations

import argparse
import codecs
import io
import os
import pickle
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckptfix
from ckptfix.conversion import convert_file
from ckptfix.errors import FormatError, OutputError, UnsafeCheckpointError
from ckptfix.formats.registry import detect_format
from ckptfix.torchcompat import safe_globals
from tests.assertions import assert_same
from tests.models import PROBE, make_net, wrap

FORMATS = {"zip": ".pt", "legacy": ".pth", "safetensors": ".safetensors"}


def write(obj: Any, path: Path, fmt: str) -> None:
    if fmt == "legacy":
        torch.save(obj, path, _use_new_zipfile_serialization=False)
    elif fmt == "zip":
        torch.save(obj, path)
    else:
        ckptfix.save(obj, path)


def full_checkpoint(kind: str) -> dict[str, Any]:
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(PROBE).sum().backward()
    optimizer.step()
    net.load_state_dict(make_net().state_dict())
    return {
        "epoch": 7,
        "model": wrap(kind, net).state_dict(),
        "optimizer": optimizer.state_dict(),
        "args": {"lr": 0.1},
    }


@pytest.mark.parametrize("src_fmt", list(FORMATS))
@pytest.mark.parametrize("dst_fmt", ["zip", "safetensors"])
@pytest.mark.parametrize("kind", ["dp", "compiled", "ddp-compiled"])
def test_every_format_pair_loads_strictly_with_equal_outputs(
    tmp_path: Path, src_fmt: str, dst_fmt: str, kind: str, wrapped_state: Callable[[str], Any]
) -> None:
    src = tmp_path / f"in{FORMATS[src_fmt]}"
    dst = tmp_path / f"out{FORMATS[dst_fmt]}"
    write(wrapped_state(kind), src, src_fmt)
    before = src.read_bytes()
    convert_file(src, dst, to="single")
    assert src.read_bytes() == before
    for target_kind in ("single", "ddp"):
        net = make_net(seed=99)
        model = wrap(target_kind, net)
        ckptfix.load_into(model, dst, strict=True)
        assert torch.equal(net(PROBE), make_net()(PROBE))


@pytest.mark.parametrize("src_fmt", ["zip", "legacy"])
@pytest.mark.parametrize("fast", [True, False])
def test_sets_complex_numbers_and_bytes_load_on_every_torch(tmp_path: Path, src_fmt: str, fast: bool) -> None:
    # torch 2.4 and 2.5 refuse them weights-only; the legacy format and the torch path reach torch.load
    cfg = {"tags": {"a", "b"}, "z": 1 + 2j, "raw": b"xy", "buf": bytearray(b"z")}
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    write({"model": {"module.w": torch.arange(3.0)}, "cfg": cfg}, src, src_fmt)
    assert ckptfix.load(src)["cfg"] == cfg
    convert_file(src, dst, to="single", fast=fast)
    out = ckptfix.load(dst)
    assert out["cfg"] == cfg and torch.equal(out["model"]["w"], torch.arange(3.0))


@pytest.mark.parametrize("src_fmt", ["zip", "legacy"])
def test_full_checkpoint_keeps_other_entries_and_optimizer(tmp_path: Path, src_fmt: str, gloo_world: None) -> None:
    ckpt = full_checkpoint("ddp")
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    write(ckpt, src, src_fmt)
    convert_file(src, dst, to="single")
    out = ckptfix.load(dst)
    assert list(out) == list(ckpt)
    assert out["epoch"] == 7 and out["args"] == {"lr": 0.1}
    assert set(out["model"]) == {k.removeprefix("module.") for k in ckpt["model"]}
    assert out["optimizer"]["param_groups"] == ckpt["optimizer"]["param_groups"]
    for index, state in ckpt["optimizer"]["state"].items():
        assert torch.equal(out["optimizer"]["state"][index]["momentum_buffer"], state["momentum_buffer"])
    # The optimizer state still drives the same parameters after the layout change.
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    optimizer.load_state_dict(out["optimizer"])


def test_convert_never_mutates_its_input(wrapped_state: Callable[[str], Any]) -> None:
    ckpt = {"model": wrapped_state("ddp"), "epoch": 1}
    keys = list(ckpt["model"])
    metadata = dict(ckpt["model"]._metadata)
    out = ckptfix.convert(ckpt, to="single")
    assert list(ckpt["model"]) == keys and dict(ckpt["model"]._metadata) == metadata
    assert out is not ckpt and out["model"] is not ckpt["model"]
    assert list(out["model"]._metadata) == [
        "",
        "features",
        "features.0",
        "features.1",
        "features.2",
        "features.3",
        "features.4",
        "features.5",
        "features.6",
        "head",
    ]


def test_safetensors_ties_are_stored_once_and_restored(tmp_path: Path) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.embed.weight

    state = Tied().state_dict()
    state["transposed"] = torch.arange(6.0).reshape(2, 3).t()  # non-contiguous
    path = tmp_path / "tied.safetensors"
    ckptfix.save(state, path)
    from safetensors.torch import load_file

    assert set(load_file(path)) == {"embed.weight", "transposed"}
    back = ckptfix.load(path)
    assert list(back) == list(state)
    assert back["out.weight"] is back["embed.weight"]
    assert torch.equal(back["transposed"], state["transposed"])


def test_safetensors_refuses_optimizer_state_with_a_way_out(tmp_path: Path, gloo_world: None) -> None:
    src, dst = tmp_path / "in.pt", tmp_path / "out.safetensors"
    torch.save(full_checkpoint("single"), src)
    with pytest.raises(OutputError, match=r"entry 'optimizer'.*write a \.pt file.*model_only=True"):
        convert_file(src, dst)
    assert not dst.exists()
    convert_file(src, dst, model_only=True)
    assert set(ckptfix.load(dst)) == set(make_net().state_dict())


def test_safetensors_keeps_simple_entries_and_module_versions(tmp_path: Path) -> None:
    ckpt = {"epoch": 3, "model": make_net().state_dict(), "config": {"lr": 0.1, "layers": [1, 2]}}
    path = tmp_path / "full.safetensors"
    ckptfix.save(ckpt, path)
    back = ckptfix.load(path)
    assert list(back) == ["epoch", "model", "config"]
    assert back["epoch"] == 3 and back["config"] == {"lr": 0.1, "layers": [1, 2]}
    assert dict(back["model"]._metadata) == dict(ckpt["model"]._metadata)


class Marker:
    """A payload that would create a file if it were ever unpickled for real."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("force_unsafe_env", [False, True])
def test_malicious_pickle_is_refused_and_never_runs(
    tmp_path: Path, legacy: bool, force_unsafe_env: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "PWNED"
    path = tmp_path / "evil.pt"
    payload = {"model": make_net().state_dict(), "extra": [{"deep": Marker(marker)}]}
    torch.save(payload, path, _use_new_zipfile_serialization=not legacy)
    if force_unsafe_env:
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(UnsafeCheckpointError, match=r"system, which can run code; nothing was executed"):
        ckptfix.load(path)
    if legacy:  # read by the torch path, which writes only what it built
        with pytest.raises(UnsafeCheckpointError):
            convert_file(path, tmp_path / "out.pt")
        assert not (tmp_path / "out.pt").exists()
    else:  # a full .pt conversion copies the entry beside the model as its records, never run: refused as its input
        result = convert_file(path, tmp_path / "out.pt")
        assert any("copied, never executed" in note and "posix.system" in note for note in result.notes)
        with pytest.raises(UnsafeCheckpointError, match=r"system, which can run code; nothing was executed"):
            ckptfix.load(tmp_path / "out.pt")
    with pytest.raises(UnsafeCheckpointError):
        convert_file(path, tmp_path / "out.safetensors")
    assert not marker.exists()
    assert not (tmp_path / "out.safetensors").exists()


def test_dangerous_globals_cannot_be_allowed(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"x": Marker(tmp_path / "PWNED")}, path)
    for name in (
        "os.system",
        "posix.system",
        "builtins.eval",
        "builtins.exec",
        "builtins.getattr",
        "sys.modules",
    ):
        with pytest.raises(UnsafeCheckpointError, match="no option allows it"):
            ckptfix.load(path, allow_globals=[name])
    assert not (tmp_path / "PWNED").exists()


def test_namespace_args_need_allow_global(tmp_path: Path) -> None:
    path = tmp_path / "ns.pt"
    torch.save({"model": make_net().state_dict(), "args": argparse.Namespace(lr=0.1)}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"argparse\.Namespace.*allow_globals='argparse\.Namespace'"):
        ckptfix.load(path)
    assert ckptfix.load(path, allow_globals=["argparse.Namespace"])["args"].lr == 0.1


def damaged(tmp_path: Path, how: str) -> Path:
    good = tmp_path / "good.pt"
    torch.save({"model": make_net().state_dict(), "epoch": 1}, good)
    data = bytearray(good.read_bytes())
    path = tmp_path / f"{how}.pt"
    if how == "empty":
        data = bytearray()
    elif how == "text":
        data = bytearray(b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\n")
    elif how.startswith("truncated"):
        data = data[: len(data) * int(how.removeprefix("truncated")) // 100]
    elif how == "bitflip":
        # Flip a bit inside a tensor record: torch itself would load this without complaint.
        import zipfile

        with zipfile.ZipFile(good) as zf:
            info = next(i for i in zf.infolist() if i.filename.endswith("/data/0"))
        name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
        data[info.header_offset + 30 + name_len + extra_len + 2] ^= 0x01
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("how", ["empty", "text", "truncated1", "truncated50", "truncated90", "truncated99", "bitflip"])
def test_damaged_files_give_one_line_errors_and_no_output(tmp_path: Path, how: str) -> None:
    path = damaged(tmp_path, how)
    with pytest.raises(FormatError) as info:
        convert_file(path, tmp_path / "out.pt")
    message = str(info.value)
    assert message.startswith(str(path)) and "\n" not in message
    assert not (tmp_path / "out.pt").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_format_is_decided_by_content(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    ckptfix.save(make_net().state_dict(), tmp_path / "w.safetensors")
    path.write_bytes((tmp_path / "w.safetensors").read_bytes())
    assert detect_format(path) == "safetensors"
    assert set(ckptfix.load(path)) == set(make_net().state_dict())


def test_output_gets_umask_mode_not_0600(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        ckptfix.save(make_net().state_dict(), tmp_path / "a.pt")
        ckptfix.save(make_net().state_dict(), tmp_path / "a.safetensors")
    finally:
        os.umask(old)
    assert (tmp_path / "a.pt").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "a.safetensors").stat().st_mode & 0o777 == 0o644


def test_failed_write_leaves_previous_file(tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    ckptfix.save({"a": torch.zeros(2)}, out)
    before = out.read_bytes()

    class Unpicklable:
        def __reduce__(self) -> Any:
            raise pickle.PicklingError("cannot pickle this")

    with pytest.raises(OutputError, match="cannot pickle this"):
        ckptfix.save({"a": torch.ones(2), "b": Unpicklable()}, out)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.pt"]


def test_writing_onto_the_input_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.pt"
    torch.save(make_net().state_dict(), path)
    before = path.read_bytes()
    with pytest.raises(OutputError, match="is the input file"):
        convert_file(path, path)
    link = tmp_path / "link.pt"
    link.symlink_to(path)
    with pytest.raises(OutputError, match="is the input file"):
        convert_file(path, link)
    assert path.read_bytes() == before


@pytest.mark.parametrize("fast", [True, False])
def test_both_paths_say_what_safetensors_cannot_keep_of_parameters(tmp_path: Path, fast: bool) -> None:
    layer = torch.nn.Linear(3, 2)
    torch.save({"w": layer.weight, "g": torch.ones(2, requires_grad=True), "b": torch.zeros(2)}, tmp_path / "in.pt")
    result = convert_file(tmp_path / "in.pt", tmp_path / "out.safetensors", to=None, fast=fast)
    assert result.method == ("stream" if fast else "torch")
    expected = ".safetensors keeps values only: 1 Parameters stored as tensors, 2 requires_grad flags not kept"
    assert result.notes.count(expected) == 1


@pytest.mark.parametrize("fast", [True, False])
def test_what_safetensors_cannot_keep_is_said_once_under_verbose(tmp_path: Path, fast: bool) -> None:
    from click.testing import CliRunner

    from ckptfix.cli import cli

    layer = torch.nn.Linear(3, 2)
    torch.save({"w": layer.weight, "v": torch.arange(12.0).reshape(3, 4)[:, :2]}, tmp_path / "in.pt")
    args = ["convert", str(tmp_path / "in.pt"), str(tmp_path / "out.safetensors"), "-v"] + (
        [] if fast else ["--no-fast"]
    )
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    expected = (
        ".safetensors keeps values only: 1 Parameters stored as tensors, 1 views stored as contiguous tensors, "
        "1 requires_grad flags not kept"
    )
    assert result.stderr.count(expected) == 1
    out = ckptfix.load(tmp_path / "out.safetensors")
    assert torch.equal(out["w"], layer.weight.detach()) and torch.equal(
        out["v"], torch.arange(12.0).reshape(3, 4)[:, :2]
    )


def test_safetensors_output_needs_no_numpy(tmp_path: Path) -> None:
    # numpy is not a dependency: `pip install ckptfix` alone must write .safetensors on the torch path too
    torch.save({"module.w": torch.arange(6.0).reshape(2, 3).t()}, tmp_path / "in.pt")
    code = (
        "import sys; sys.modules['numpy'] = None\n"
        "import ckptfix\n"
        f"r = ckptfix.convert_file({str(tmp_path / 'in.pt')!r}, {str(tmp_path / 'out.safetensors')!r}, fast=False)\n"
        "print(r.method)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "torch", proc.stderr
    out = ckptfix.load(tmp_path / "out.safetensors")
    assert torch.equal(out["w"], torch.arange(6.0).reshape(2, 3).t())


def test_tensors_built_from_the_description_equal_torch_load(tmp_path: Path) -> None:
    net = make_net()
    opt = torch.optim.Adam(net.parameters())
    net(PROBE).sum().backward()
    opt.step()
    weight = next(net.parameters())
    ckpt = {
        "model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": 3, "tied": [weight, weight],
        "dtype": torch.float16, "size": torch.Size([2, 3]), "device": torch.device("cpu"), "set": {1, 2},
        "complex": 1 + 2j, "bytes": b"xy", "view": torch.arange(12.0).reshape(3, 4)[:, 1:],
        "empty": torch.empty(0, 3), "half": torch.ones(2, dtype=torch.bfloat16), "flags": torch.tensor([True]),
    }  # fmt: skip
    torch.save(ckpt, tmp_path / "rich.pt")
    for mmap in (True, False):
        ours = ckptfix.load(tmp_path / "rich.pt", mmap=mmap)
        # what torch's weights-only load allows by default from torch 2.6 on (bytes pickle as _codecs.encode)
        with safe_globals([set, complex, codecs.encode]):
            assert_same(ours, torch.load(tmp_path / "rich.pt", weights_only=True))
        assert ours["tied"][0] is ours["tied"][1]  # shared stays shared, as torch.load keeps it
        assert isinstance(ours["tied"][0], nn.Parameter) and ours["tied"][0].requires_grad
    mapped = ckptfix.load(tmp_path / "rich.pt", mmap=True)
    mapped["view"].add_(1)  # copy-on-write: the file is never written through a loaded tensor
    assert torch.equal(torch.load(tmp_path / "rich.pt")["view"], ckpt["view"])


# Broken and hostile inputs: nothing runs, nothing crashes, nothing is half-written, the input is untouched.


@pytest.mark.parametrize("fast", [True, False])
def test_malformed_module_versions_are_refused_on_both_paths(tmp_path: Path, fast: bool) -> None:
    from collections import OrderedDict

    state: Any = OrderedDict(w=torch.zeros(2))
    state._metadata = OrderedDict({"": [1, 2]})  # torch's load_state_dict expects {"": {"version": 1}}
    torch.save(state, tmp_path / "md.pt")
    for out in ("out.pt", "out.safetensors"):
        with pytest.raises(FormatError, match=r"md\.pt: a state dict's _metadata is not a mapping of module paths"):
            convert_file(tmp_path / "md.pt", tmp_path / out, fast=fast)
        assert not (tmp_path / out).exists()


# Hostile files made byte by byte (tests/hostile.py) against every entry point (tests/entry_points.py): both
# conversion paths, load and inspect refuse them with the right error in one line naming the file, no output left, the
# input unchanged, no payload run. The case number in a test's name is the class of attack (case1: code globals ..
# case6: builtin containers).


# The console script beside this interpreter when it is installed (a venv), else the module: a checkout on PYTHONPATH.
_SCRIPT = Path(sys.executable).parent / "ckptfix"
CKPTFIX = [os.fsencode(_SCRIPT)] if _SCRIPT.exists() else [os.fsencode(sys.executable), b"-m", b"ckptfix"]


@pytest.mark.parametrize("content", ["valid", "truncated"])
def test_case5_non_utf8_file_names(tmp_path: Path, content: str) -> None:
    """A file name that is not UTF-8: converted on both paths, or refused on both in one line; never a crash."""
    folder = os.fsencode(tmp_path)
    src = folder + b"/ck\xffpt.pt"
    buffer = io.BytesIO()
    torch.save({"model": {"module.w": torch.arange(4.0)}}, buffer)
    data = buffer.getvalue() if content == "valid" else buffer.getvalue()[:300]
    with open(src, "wb") as f:
        f.write(data)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONUTF8", "PYTHONIOENCODING", "LANG", "LC_ALL")}
    env["LC_ALL"] = "C.UTF-8"  # a UTF-8 terminal: stdout is strict about surrogates
    answers: dict[str, int] = {}
    problems: list[str] = []
    for flags in ([], [b"--no-fast"]):
        what = "convert" + (" --no-fast" if flags else "")
        out = folder + b"/out\xfe" + (b"-nf" if flags else b"") + b".pt"
        proc = subprocess.run(
            [*CKPTFIX, b"convert", src, out, *flags],
            capture_output=True,
            env=env,
            timeout=120,
        )
        answers[what] = proc.returncode
        stderr = proc.stderr.decode("utf-8", "replace").strip()
        if proc.returncode == 2:
            if "\n" in stderr or "ck" not in stderr or "Traceback" in stderr:
                problems.append(f"{what}: not a one-line error naming the file: {stderr[:300]!r}")
            if os.path.exists(out):
                problems.append(f"{what}: refused, but wrote its output")
        elif proc.returncode == 0:
            readable = tmp_path / f"copy-{len(flags)}.pt"  # read back under a plain name: only the output is judged
            with open(out, "rb") as f:
                readable.write_bytes(f.read())
            loaded = ckptfix.load(readable)
            if list(loaded["model"]) != ["w"] or not torch.equal(loaded["model"]["w"], torch.arange(4.0)):
                problems.append(f"{what}: wrote {loaded}")
        else:
            problems.append(f"{what}: exit {proc.returncode}: {stderr[-300:]!r}")
    if len(set(answers.values())) != 1:
        problems.append(f"the paths disagree (exit codes {answers})")
    if content == "truncated" and set(answers.values()) != {2}:
        problems.append(f"a truncated file was not refused: {answers}")
    with open(src, "rb") as f:
        if f.read() != data:
            problems.append("the input was modified")
    assert not problems, "\n".join(problems)
