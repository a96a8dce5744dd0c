"""ckptfix.formats.output.atomic: outputs written whole or not at all, never onto an input, with the mode the umask
gives.

``--force`` (``overwrite=True``) is one rule for files and folders: an existing output is refused (exit 2, naming
the flag) unless asked, and then replaced only once the new one is whole; a folder output (a DCP folder, a shard
set) is written beside the old one and swapped in, never onto anything but a checkpoint, never onto an input."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

import ckptfix
from ckptfix.cli import cli
from ckptfix.conversion.files import convert_file
from ckptfix.errors import OutputError
from tests.inputs import _hf, _tree_hash
from tests.models import make_file, make_net, wrap

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"
SINGLE, DDP = FIXTURES / "single.pt", FIXTURES / "ddp_wrapped.pt"


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (relative) and its SHA-256: what a refusal or a failure must leave as it was."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
        for p in sorted(root.rglob("*"))
    }


def refused(result: Result, *words: str) -> str:
    assert result.exit_code == 2, result.output
    message = result.stderr.strip()
    assert "\n" not in message and message.startswith("ckptfix: error: ")
    for word in words:
        assert word in message, message
    return message


def model(path: Path) -> dict[str, torch.Tensor]:
    loaded = ckptfix.load(path)
    return loaded.get("model", loaded)  # type: ignore[no-any-return]


# -- DCP folders ------------------------------------------------------------------------------------------------


def test_a_dcp_folder_is_replaced_only_with_force(tmp_path: Path) -> None:
    out = tmp_path / "dcp"
    assert run("convert", SINGLE, f"{out}/").exit_code == 0
    before = tree(tmp_path)
    refused(run("convert", DDP, f"{out}/"), str(out), "exists and is not empty", "--force")
    assert tree(tmp_path) == before
    result = run("convert", DDP, f"{out}/", "--force", "--to", "ddp")
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(tmp_path)) == ["dcp"]  # no temp folder, no old folder left beside it
    assert all(k.startswith("module.") for k in model(out))  # the new checkpoint (the old one was single)


def test_force_replaces_only_a_dcp_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / ".metadata").write_bytes(b"x")
    (out / "notes.txt").write_text("precious")
    before = tree(tmp_path)
    refused(run("convert", SINGLE, f"{out}/", "--force"), "notes.txt", "is not a file of a DCP checkpoint", "--force")
    (out / "notes.txt").unlink()
    (out / "sub").mkdir()
    refused(run("convert", SINGLE, f"{out}/", "--force"), "sub", "is not a file of a DCP checkpoint")
    (out / "sub").rmdir()
    os.symlink(SINGLE, out / "__0_0.distcp")
    refused(run("convert", SINGLE, f"{out}/", "--force"), "__0_0.distcp")
    assert tree(tmp_path) == {**{k: v for k, v in before.items() if "notes" not in k}, "mine/__0_0.distcp": tree(
        FIXTURES)["single.pt"]}  # fmt: skip


def test_force_never_replaces_the_input(tmp_path: Path) -> None:
    dcp = tmp_path / "dcp"
    assert run("convert", SINGLE, f"{dcp}/").exit_code == 0
    before = tree(tmp_path)
    refused(run("convert", dcp, f"{dcp}/", "--force"), "input")
    inner = dcp / "__0_0.distcp"
    refused(run("convert", inner, f"{dcp}/", "--force", "--no-fast"), "input")
    assert tree(tmp_path) == before


def test_a_failed_write_leaves_the_old_dcp_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "dcp"
    ckptfix.save({"w": torch.zeros(2)}, f"{out}/")
    before = tree(tmp_path)

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("ckptfix.torchcompat.dcp_save_local", broken)
    with pytest.raises(OSError, match="No space"):
        ckptfix.save({"w": torch.ones(2)}, f"{out}/", overwrite=True)
    assert tree(tmp_path) == before


def test_a_failed_swap_puts_the_old_dcp_folder_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "dcp"
    ckptfix.save({"w": torch.zeros(2)}, f"{out}/")
    before = tree(tmp_path)
    rename = os.rename

    def failing(src: str, dst: str) -> None:  # the old folder goes aside; the new one cannot come in
        if os.fspath(dst) == str(out) and ".ckptfix-old." not in os.fspath(src):
            raise OSError(5, "Input/output error")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OutputError, match=r"cannot put the new folder in place \(Input/output error\); nothing"):
        ckptfix.save({"w": torch.ones(2)}, f"{out}/", overwrite=True)
    monkeypatch.undo()
    assert tree(tmp_path) == before
    assert torch.equal(ckptfix.load(out)["w"], torch.zeros(2))
    ckptfix.save({"w": torch.ones(2)}, f"{out}/", overwrite=True)
    assert torch.equal(ckptfix.load(out)["w"], torch.ones(2)) and sorted(os.listdir(tmp_path)) == ["dcp"]


# -- shard sets -----------------------------------------------------------------------------------------------------


def test_a_shard_set_is_replaced_only_with_force(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    assert run("convert", SINGLE, f"{folder}/", "--model-only", "--shard-size", "10kB").exit_code == 0
    (folder / "config.json").write_text("{}")  # what a transformers folder holds beside its shards
    old = sorted(os.listdir(folder))
    assert old == ["config.json", *(f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)),
                   "model.safetensors.index.json"]  # fmt: skip
    before = tree(tmp_path)
    # a set of another count would leave the old shards beside the new index: refused as well
    refused(run("convert", SINGLE, f"{folder}/", "--model-only", "--shard-size", "5kB"), "already exists", "--force")
    assert tree(tmp_path) == before
    result = run("convert", SINGLE, f"{folder}/", "--model-only", "--shard-size", "5kB", "--force")
    assert result.exit_code == 0, result.output
    new = sorted(os.listdir(folder))
    assert new == ["config.json", *(f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)),
                   "model.safetensors.index.json"]  # fmt: skip
    assert (folder / "config.json").read_text() == "{}"  # never touched
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    expected = model(SINGLE)
    assert sorted(model(folder)) == sorted(expected)
    # one shard: written as OUT itself, the old set and its index gone
    result = run("convert", SINGLE, folder / "model.safetensors", "--model-only", "--shard-size", "1GB", "--force")
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]


def test_force_never_replaces_a_shard_that_is_read(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    ckptfix.save(model(SINGLE), folder / "model.safetensors", shard_size=10_000)
    before = tree(tmp_path)
    shard = folder / "model-00001-of-00003.safetensors"
    refused(run("convert", shard, folder / "model.safetensors", "--shard-size", "5kB", "--force"), str(shard), "input")
    assert tree(tmp_path) == before
    with pytest.raises(OutputError, match="input"):
        ckptfix.convert_file(shard, folder / "model.safetensors", shard_size=5000, overwrite=True)
    assert tree(tmp_path) == before


def test_a_failed_shard_write_leaves_the_old_set(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    ckptfix.save(model(SINGLE), folder / "model.safetensors", shard_size=10_000)
    before = tree(tmp_path)
    bad = {**model(SINGLE), "zz": torch.zeros(2, dtype=torch.complex32)}  # safetensors cannot store it: the last
    with pytest.raises(OutputError):  # shard fails
        ckptfix.save(bad, folder / "model.safetensors", shard_size=5000, overwrite=True)
    assert tree(tmp_path) == before
    with pytest.raises(OutputError, match=r"already exists.*overwrite=True"):
        ckptfix.save(model(SINGLE), folder / "model.safetensors", shard_size=5000)
    assert tree(tmp_path) == before


def test_a_failed_shard_swap_puts_the_old_set_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "hf"
    ckptfix.save(model(SINGLE), folder / "model.safetensors", shard_size=10_000)
    before = tree(tmp_path)
    rename = os.rename
    calls: list[str] = []

    def failing(src: str, dst: str) -> None:  # the last new file (the index) cannot come in
        if os.path.dirname(os.fspath(dst)) == str(folder):
            calls.append(os.fspath(dst))
            if len(calls) == 5:  # after the 3 old files went aside, the 4 new ones come in
                raise OSError(5, "Input/output error")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OutputError, match="cannot put the new shards in place"):
        ckptfix.save(model(SINGLE), folder / "model.safetensors", shard_size=5000, overwrite=True)
    monkeypatch.undo()
    assert tree(tmp_path) == before


# Broken and hostile inputs: nothing runs, nothing crashes, nothing is half-written, the input is untouched.


@pytest.mark.parametrize("where", ["write", "fsync", "replace"])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_injected_io_errors_leave_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, code: int
) -> None:
    src = tmp_path / "in.pt"
    torch.save({"model": {f"module.{k}": v for k, v in make_net().state_dict().items()}}, src)
    before = src.read_bytes()
    out = tmp_path / "out.pt"

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise OSError(code, os.strerror(code))

    if where == "write":
        import ckptfix.formats.torchio.torchfile as torchfile

        monkeypatch.setattr(torchfile, "save_torch", lambda obj, path: _save_failing(obj, path, fail))
    else:
        monkeypatch.setattr(os, where, fail)
    with pytest.raises(OutputError, match=os.strerror(code)):
        convert_file(src, out, fast=False)
    monkeypatch.undo()
    assert src.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]


def _save_failing(obj: Any, path: Any, fail: Any) -> None:
    from ckptfix.formats.output.atomic import atomic_output

    with atomic_output(path) as f:
        f.write(b"partial")
        fail()


@pytest.mark.slow  # 50 forked writers of 16 MB files
def test_sigkill_during_writes_never_leaves_a_partial_file(tmp_path: Path) -> None:
    import random
    import signal
    import time

    out = tmp_path / "out.pt"
    state = {f"w{i}": torch.full((256, 1024), float(i)) for i in range(16)}  # 16 MB per file
    rng = random.Random(0)
    complete = 0
    for trial in range(50):
        # fork, not a fresh interpreter: the writer must be in the middle of a write, not importing torch
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child only writes until it is killed
            try:
                while True:
                    ckptfix.save(state, out)
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0.0, 0.2))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if out.exists():
            loaded = ckptfix.load(out)
            assert len(loaded) == 16 and torch.equal(loaded["w15"], state["w15"]), trial
            complete += 1
    assert complete > 0  # some writes finished; each of them is whole
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["out.pt"]


def test_missing_output_folder_fails_before_reading(tmp_path: Path) -> None:
    with pytest.raises(OutputError, match="does not exist"):
        convert_file(tmp_path / "also-missing.pt", tmp_path / "no" / "out.pt")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores folder permissions")
def test_read_only_output_folder(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    src = make_file(tmp_path, "zip")
    with pytest.raises(OutputError, match="not writable"):
        convert_file(src, folder / "out.pt")


def test_read_only_output_folder_is_refused_before_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Root ignores permission bits, so the folder's answer to access(W_OK) is simulated.
    folder = tmp_path / "ro"
    folder.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == folder else real_access(p, mode))
    with pytest.raises(OutputError, match="is not writable; choose another output path"):
        convert_file(tmp_path / "not-even-read.pt", folder / "out.pt")


@pytest.mark.parametrize("where", ["fsync", "replace"])
def test_injected_io_errors_on_the_streaming_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    src = tmp_path / "in.pt"
    torch.save({"model": {f"module.{k}": v for k, v in make_net().state_dict().items()}}, src)
    before = src.read_bytes()

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    probe = tmp_path / "probe.pt"
    assert convert_file(src, probe).method == "stream"  # the input really takes the streaming path
    probe.unlink()
    monkeypatch.setattr(os, where, fail)
    with pytest.raises(OutputError, match="No space left"):
        convert_file(src, tmp_path / "out.pt")
    monkeypatch.undo()
    assert src.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]


# Inputs are never outputs: an output that is, or sits inside, anything the command reads is refused with exit 2
# naming both, before anything is written (hard and symbolic links included).


@pytest.mark.parametrize("command", ["convert", "sanitize", "merge"])
@pytest.mark.parametrize("link", ["hard", "symbolic"])
def test_a_link_to_the_input_is_the_input(tmp_path: Path, command: str, link: str) -> None:
    src = tmp_path / "in.pt"
    torch.save({"model": wrap("dp", make_net()).cpu().state_dict()}, src)
    other = tmp_path / "other.pt"
    torch.save({"model": wrap("dp", make_net()).cpu().state_dict()}, other)
    out = tmp_path / "alias.pt"
    (os.link if link == "hard" else os.symlink)(src, out)
    args = {"convert": ["convert", str(src), str(out)], "sanitize": ["sanitize", str(src), str(out)],
            "merge": ["merge", str(other), str(src), "-o", str(out)]}[command]  # fmt: skip
    before = src.read_bytes()
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert str(out) in result.output and "input" in result.output
    assert src.read_bytes() == before


def test_the_library_refuses_alike(tmp_path: Path) -> None:
    folder = _hf(tmp_path / "in", "model.safetensors")
    before = _tree_hash(folder)
    with pytest.raises(OutputError, match="inside the input folder"):
        ckptfix.convert_file(folder, folder / "x.pt")
    with pytest.raises(OutputError, match="inside the input folder"):
        ckptfix.convert_file(folder, str(folder / "dcp") + "/")  # a DCP folder output
    with pytest.raises(OutputError, match="inside the input folder"):
        ckptfix.convert_file(folder, folder / "sub" / "m.safetensors", shard_size=600)
    with pytest.raises(OutputError, match="holds the input folder"):
        ckptfix.convert_file(folder, str(tmp_path) + "/")
    assert _tree_hash(folder) == before


@pytest.mark.parametrize("command", ["convert", "sanitize", "merge"])
def test_an_existing_output_is_replaced_only_when_asked(tmp_path: Path, command: str) -> None:
    src = tmp_path / "in.pt"
    torch.save({"model": wrap("dp", make_net()).cpu().state_dict()}, src)
    out = tmp_path / "out.pt"
    out.write_bytes(b"precious")
    args = {"convert": ["convert", str(src), str(out)], "sanitize": ["sanitize", str(src), str(out)],
            "merge": ["merge", str(src), str(src), "-o", str(out)]}[command]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and f"{out}: already exists" in result.output and "--force" in result.output
    assert out.read_bytes() == b"precious"
    result = CliRunner().invoke(cli, [*args, "--force"])
    assert result.exit_code == 0, result.output
    assert any(k.endswith("head.weight") for k in torch.load(out, weights_only=True)["model"])


def test_the_library_refuses_an_existing_output_unless_overwrite(tmp_path: Path) -> None:
    src, out = tmp_path / "in.pt", tmp_path / "out.safetensors"
    torch.save(make_net().state_dict(), src)
    out.write_bytes(b"precious")
    for call in (lambda **kw: ckptfix.convert_file(src, out, **kw), lambda **kw: ckptfix.sanitize(src, out, **kw)):
        with pytest.raises(OutputError, match=r"already exists; write to a new path, or pass overwrite=True"):
            call()
        assert out.read_bytes() == b"precious"
    ckptfix.convert_file(src, out, overwrite=True)
    assert "head.weight" in ckptfix.load(out)


# Outputs get the mode the umask gives, as open/mkdir would (docs/safety.md): files 0666 & ~umask, folders (a DCP
# checkpoint, written in a private staging folder and renamed into place) 0777 & ~umask; an existing empty folder
# written into keeps its own mode.


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def source(tmp_path: Path) -> Path:
    src = tmp_path / "src.pt"
    torch.save({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}, src)
    return src


def convert(*args: str) -> None:
    result = CliRunner().invoke(cli, ["convert", *args])
    assert result.exit_code == 0, result.output


def test_file_outputs_follow_the_umask(umask: int, tmp_path: Path) -> None:
    src = source(tmp_path)
    for name in ("out.safetensors", "out.pt"):
        convert(str(src), str(tmp_path / name))
        assert mode(tmp_path / name) == 0o666 & ~umask, name
    shards = tmp_path / "shards"
    shards.mkdir()
    convert(str(src), str(shards / "model.safetensors"), "--shard-size", "20")
    assert len(list(shards.iterdir())) > 2
    for f in shards.iterdir():
        assert mode(f) == 0o666 & ~umask, f.name


@pytest.mark.parametrize("how", ["convert", "save"])
def test_dcp_folders_follow_the_umask(how: str, umask: int, tmp_path: Path) -> None:
    src = source(tmp_path)
    for name in ("run_dcp", "hf_dir"):
        out = tmp_path / name
        if how == "convert":  # streamed
            convert(str(src), f"{out}/")
        else:
            ckptfix.save(ckptfix.load(src), f"{out}/")
        assert mode(out) == 0o777 & ~umask, name
        assert os.listdir(out)
        for f in out.iterdir():
            assert mode(f) == 0o666 & ~umask, f.name
        assert not [n for n in os.listdir(tmp_path) if n.endswith(".ckptfix-tmp")]


def test_an_existing_empty_folder_keeps_its_mode(umask: int, tmp_path: Path) -> None:
    src = source(tmp_path)
    out = tmp_path / "run_dcp"
    out.mkdir()
    out.chmod(0o755)
    convert(str(src), str(out))
    assert mode(out) == 0o755
    out2 = tmp_path / "shared_dcp"
    out2.mkdir()
    out2.chmod(0o2770)  # setgid, group-writable: a team's folder stays one
    ckptfix.save(ckptfix.load(src), str(out2))
    assert mode(out2) == 0o2770
