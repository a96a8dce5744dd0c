"""Mutation fuzzing of the folder readers through the CLI: real folders, edited, then ``inspect``/``convert``/``merge``.

The folders are written once per module by the real writers: transformers shards (safetensors and
``pytorch_model.bin``, with their index), an accelerate-like folder (``model.safetensors`` + ``optimizer.bin``), a
DCP folder, and the FSDP2 rank files. Each example copies one to a fresh folder and edits it: the index JSON
(weight_map names and files, metadata.total_size, duplicated or dropped keys, values of other types), the DCP
``.metadata`` (sizes, chunk offsets and sizes, storage offsets, lengths and files, planner paths, dtypes), the
bytes of any file (flips, truncations), or the DTensors of a rank file (mesh coordinate, placements, local shard).

Invariants: exit 0 or 2 (1 too for merge, which reports disagreement), never 3 nor an uncaught exception; on 2 one
line ``ckptfix: error: ...`` and neither an output nor a temp file left; the input's bytes unchanged; each run
within 20 s.

CI runs a few dozen examples per target (seconds). A longer campaign:

    CKPTFIX_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest tests/test_fuzz_folders.py -q
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

import ckptfix
from ckptfix.cli import cli
from tests import sharded_writers
from tests.fuzzing import FUZZ
from tests.models import make_net

SECONDS = 20  # the most one command may take on any input of these sizes

# --- the folders, written once per module ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("folders")
    state = make_net().state_dict()
    made = {name: base / name for name in ("hf", "hf-bin", "accelerate", "dcp")}
    for path in made.values():
        path.mkdir()
    ckptfix.save(state, made["hf"] / "model.safetensors", shard_size=600)
    ckptfix.save(state, made["hf-bin"] / "pytorch_model.bin", shard_size=600)
    ckptfix.save(state, made["accelerate"] / "model.safetensors")
    optimizer = torch.optim.SGD(make_net().parameters(), lr=0.1, momentum=0.9)
    torch.save(optimizer.state_dict(), made["accelerate"] / "optimizer.bin")
    ckptfix.save({"model": make_net().state_dict(), "epoch": 2}, str(made["dcp"]) + "/")
    return made


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharded_writers.write(tmp_path_factory.mktemp("fsdp2"), "fsdp2")


# --- the invariants ------------------------------------------------------------------------------------------------


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def _invoke(args: list[str], out: Path, *, codes: tuple[int, ...] = (0, 2)) -> None:
    """One command: an allowed exit, one error line on 2 with nothing left in ``out``, no temp file, in time."""
    started = time.monotonic()
    result = CliRunner().invoke(cli, args)
    elapsed = time.monotonic() - started
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, result.output)
    assert result.exit_code in codes, (args, result.exit_code, result.output)
    assert elapsed < SECONDS, (args, elapsed)
    left = sorted(p.name for p in out.iterdir())
    assert not [n for n in left if n.endswith(".ckptfix-tmp")], (args, left)
    if result.exit_code == 2:
        assert result.output.startswith("ckptfix: error: ") and result.output.count("\n") == 1, (args, result.output)
        assert left == [], (args, left, result.output)
    for p in out.iterdir():
        p.unlink()


def _check_folder(folder: Path, kind: str, codes: tuple[int, ...] = (0, 2)) -> None:
    """inspect, convert to .pt, and convert --model-only to .safetensors; the folder's bytes untouched."""
    before = _digests(folder)
    entry = ["--entry", "model"] if kind == "dcp" else []
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        _invoke(["inspect", str(folder)], out, codes=codes)
        _invoke(["convert", str(folder), str(out / "out.pt")], out, codes=codes)
        _invoke(["convert", str(folder), str(out / "out.safetensors"), "--model-only", *entry], out, codes=codes)
    assert _digests(folder) == before
    assert not list(folder.rglob("*.ckptfix-tmp"))


def _check_ranks(folder: Path, codes: tuple[int, ...] = (0, 1, 2)) -> None:
    before = _digests(folder)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        ranks = [str(folder / "rank0.pt"), str(folder / "rank1.pt")]
        _invoke(["merge", *ranks, "-o", str(out / "out.safetensors")], out, codes=codes)
    assert _digests(folder) == before


def _run(seed: Path, edit: Callable[[Path], None], check: Callable[[Path], None]) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / seed.name
        shutil.copytree(seed, folder)
        edit(folder)
        check(folder)


# --- mutations: the index JSON -------------------------------------------------------------------------------------

_HUGE = [-1, 0, 2**31, 2**63, 2**64, 10**30, -(2**63), 1.5, float("inf")]
_JSON = st.recursive(
    st.none() | st.booleans() | st.sampled_from(_HUGE) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)


def _names(folder: Path) -> st.SearchStrategy[str]:
    """Names a weight_map might hold instead of its own: escapes, other files, odd characters."""
    others = sorted(p.name for p in folder.iterdir())
    odd = ["../x", "../" + others[0], "/etc/passwd", str(folder / others[0]), "a\x00b", "\ud800", "", ".", "sub/x"]
    return st.sampled_from(others + odd) | st.text(max_size=6)


@st.composite
def index_edits(draw: st.DrawFn, seed: Path) -> Callable[[Path], None]:
    index_name = next(p.name for p in seed.iterdir() if p.name.endswith(".index.json"))
    index = json.loads((seed / index_name).read_text())
    keys = sorted(index["weight_map"])
    duplicates: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["file", "name", "drop", "duplicate", "total", "value", "top"]))
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            kind = "top"
        key = draw(st.sampled_from(keys))
        if kind == "file" and isinstance(weight_map, dict):
            weight_map[key] = draw(_names(seed))
        elif kind == "name" and isinstance(weight_map, dict) and key in weight_map:
            weight_map[draw(_names(seed))] = weight_map.pop(key)
        elif kind == "drop" and isinstance(weight_map, dict):
            weight_map.pop(key, None)
        elif kind == "duplicate":
            duplicates.append((key, draw(_names(seed))))
        elif kind == "total":
            index["metadata"] = {"total_size": draw(st.sampled_from(_HUGE) | _JSON)}
        elif kind == "value" and isinstance(weight_map, dict):
            weight_map[key] = draw(_JSON)
        else:
            index[draw(st.sampled_from(["weight_map", "metadata"]))] = draw(_JSON)
    whole = draw(st.sampled_from([None] * 20 + [[], "x", 3]))
    text = json.dumps(index if whole is None else whole, ensure_ascii=draw(st.booleans()))
    for key, value in duplicates:  # a key twice in one object: json.dumps cannot write it, so splice the text
        text = text.replace('"weight_map": {', '"weight_map": {' + json.dumps(key) + ": " + json.dumps(value) + ", ", 1)
    data = text.encode("utf-8", "surrogatepass")

    def edit(folder: Path) -> None:
        (folder / index_name).write_bytes(data)

    return edit


@pytest.mark.parametrize("kind", ["hf", "hf-bin"])
def test_fuzz_index_json(folders: dict[str, Path], kind: str) -> None:
    seed = folders[kind]

    @FUZZ
    @given(index_edits(seed))
    def run(edit: Callable[[Path], None]) -> None:
        _run(seed, edit, lambda f: _check_folder(f, kind))

    run()


# --- mutations: the bytes of any file ---------------------------------------------------------------------------


@st.composite
def byte_edits(draw: st.DrawFn, seed: Path) -> Callable[[Path], None]:
    names = sorted(str(p.relative_to(seed)) for p in seed.rglob("*") if p.is_file())
    cuts: list[tuple[str, str, int, int]] = []
    for _ in range(draw(st.integers(1, 4))):
        name = draw(st.sampled_from(names))
        size = (seed / name).stat().st_size
        kind = draw(st.sampled_from(["flip", "byte", "cut", "header"] * 3 + ["empty"]))
        at = draw(st.integers(0, max(size - 1, 0)))
        if kind == "header":
            at = draw(st.integers(0, max(min(size, 128) - 1, 0)))
        cuts.append((name, kind, at, draw(st.integers(0, 255))))

    def edit(folder: Path) -> None:
        for name, kind, at, value in cuts:
            data = bytearray((folder / name).read_bytes())
            if kind == "empty":
                data.clear()
            elif kind == "cut":
                del data[at:]
            elif at < len(data):
                data[at] = data[at] ^ (1 << (value % 8)) if kind == "flip" else value
            (folder / name).write_bytes(bytes(data))

    return edit


@pytest.mark.parametrize("kind", ["hf", "hf-bin", "accelerate", "dcp"])
def test_fuzz_folder_bytes(folders: dict[str, Path], kind: str) -> None:
    seed = folders[kind]

    @FUZZ
    @given(byte_edits(seed))
    def run(edit: Callable[[Path], None]) -> None:
        _run(seed, edit, lambda f: _check_folder(f, kind))

    run()


# --- mutations: the DCP .metadata ----------------------------------------------------------------------------------

_INTS = st.sampled_from([0, 1, 2, 3, 4, 8, 16] * 3 + [-1, -5, 2**31, 2**40, 2**62, 2**63 - 1])
_PATHS = st.sampled_from(["__0_0.distcp", ".metadata", "../x", "/etc/passwd", "", ".", "a\x00b", "\ud800", "no.distcp"])
_DTYPES = st.sampled_from([torch.float16, torch.int8, torch.bool, torch.complex64, torch.float64, "float32", None])


@st.composite
def metadata_edits(draw: st.DrawFn, seed: Path) -> Callable[[Path], None]:
    meta = pickle.loads((seed / ".metadata").read_bytes())  # the module's own file
    tensors = sorted(k for k, v in meta.state_dict_metadata.items() if hasattr(v, "chunks"))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(
            st.sampled_from(
                ["size", "offsets", "sizes", "overlap", "nochunk", "dtype", "storage", "dropstore", "plan"] * 3
                + ["swap", "rekey", "transform", "version", "top"]
            )
        )
        fqn = draw(st.sampled_from(tensors))
        md = meta.state_dict_metadata.get(fqn)
        if not hasattr(md, "chunks"):  # swapped with the bytes entry
            continue
        ndim = len(md.size)
        dims = st.lists(_INTS, min_size=ndim, max_size=ndim) | st.lists(_INTS, max_size=5)
        chunk = md.chunks[0] if md.chunks else None
        if kind == "size":
            md.size = torch.Size(draw(dims))
        elif kind in ("offsets", "sizes") and chunk is not None:
            setattr(chunk, kind, torch.Size(draw(dims)))
        elif kind == "overlap" and chunk is not None:
            md.chunks.append(copy.deepcopy(chunk))
        elif kind == "nochunk":
            md.chunks = []
        elif kind == "dtype":
            md.properties.dtype = draw(_DTYPES)
        elif kind in ("storage", "dropstore"):
            index = draw(st.sampled_from(sorted(meta.storage_data, key=str)))
            if kind == "dropstore":
                del meta.storage_data[index]
            else:
                info = meta.storage_data[index]
                field = draw(st.sampled_from(["offset", "length", "relative_path"]))
                setattr(info, field, draw(_PATHS if field == "relative_path" else _INTS))
        elif kind == "swap":  # a tensor's entry made bytes, or the bytes entry made a tensor
            other = draw(st.sampled_from(sorted(meta.state_dict_metadata)))
            meta.state_dict_metadata[fqn], meta.state_dict_metadata[other] = (
                meta.state_dict_metadata[other],
                meta.state_dict_metadata[fqn],
            )
        elif kind == "rekey":
            index = draw(st.sampled_from(sorted(meta.storage_data, key=str)))
            fields = {"fqn": draw(st.sampled_from([*tensors, "epoch", "nope"])), "index": draw(_INTS | st.none())}
            offset = draw(st.none() | st.lists(_INTS, max_size=4).map(torch.Size))
            meta.storage_data[dataclasses.replace(index, offset=offset, **fields)] = meta.storage_data.pop(index)
        elif kind == "transform":
            info = meta.storage_data[draw(st.sampled_from(sorted(meta.storage_data, key=str)))]
            info.transform_descriptors = draw(st.sampled_from([["zstd"], [""], ["x"] * 3, "zstd", 3]))
        elif kind == "version":
            meta.version = draw(st.sampled_from(["9.9.9", "", None, 3, "1.0.0"]))
        elif kind == "top":
            field = draw(st.sampled_from(["state_dict_metadata", "storage_data", "planner_data"]))
            setattr(meta, field, draw(st.sampled_from([None, [], {}, "x", {"a": None}])))
            break  # nothing of that field is left to edit
        else:
            other = draw(st.sampled_from(sorted(meta.planner_data)))
            path = draw(
                st.sampled_from(
                    [
                        meta.planner_data[other],  # a duplicate
                        (*meta.planner_data[other], "x"),  # nested under another
                        meta.planner_data[other][:1],  # a prefix of another
                        (),
                        ("model", "a\x00b"),
                        "model",
                    ]
                )
            )
            meta.planner_data[fqn] = path
    data = pickle.dumps(meta)

    def edit(folder: Path) -> None:
        (folder / ".metadata").write_bytes(data)

    return edit


def test_fuzz_dcp_metadata(folders: dict[str, Path]) -> None:
    seed = folders["dcp"]

    @FUZZ
    @given(metadata_edits(seed))
    def run(edit: Callable[[Path], None]) -> None:
        _run(seed, edit, lambda f: _check_folder(f, "dcp"))

    run()


# --- mutations: FSDP2 rank files -------------------------------------------------------------------------------


@st.composite
def rank_edits(draw: st.DrawFn) -> list[tuple[int, int, str, Any]]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    placements = st.sampled_from([Shard(0), Shard(1), Shard(3), Shard(5), Shard(-1), Replicate(), Partial()])
    coordinates = st.lists(st.sampled_from([0, 1, 2, -1, 2**40]), min_size=0, max_size=2).map(tuple)
    edits = []
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(["coordinate", "placements", "local", "global"]))
        value: Any
        if field == "coordinate":
            value = draw(coordinates)
        elif field == "placements":
            value = tuple(draw(st.lists(placements, min_size=0, max_size=2)))
        elif field == "local":
            value = draw(st.lists(st.integers(0, 5), max_size=3))
        else:
            value = draw(st.lists(st.sampled_from([0, 1, 3, 8, 2**40]), max_size=5))
        edits.append((draw(st.integers(0, 1)), draw(st.integers(0, 20)), field, value))
    return edits


def _edit_ranks(edits: list[tuple[int, int, str, Any]]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        for rank in (0, 1):
            mine = [(i, f, v) for r, i, f, v in edits if r == rank]
            if not mine:
                continue
            path = folder / f"rank{rank}.pt"
            obj = torch.load(path, weights_only=False)  # the module's own file
            dtensors = [v for v in obj.values() if type(v).__name__ == "DTensor"]
            for i, field, value in mine:
                t = dtensors[i % len(dtensors)]
                if field == "coordinate":
                    object.__setattr__(t._spec.mesh, "_coordinate_on_dim", value)
                elif field == "placements":
                    object.__setattr__(t._spec, "placements", value)
                elif field == "local":
                    object.__setattr__(t, "_local_tensor", torch.zeros(value))
                else:  # the global shape it claims
                    meta = t._spec.tensor_meta
                    object.__setattr__(t._spec, "tensor_meta", meta._replace(shape=torch.Size(value)))
            torch.save(obj, path)

    return edit


def test_fuzz_rank_files(ranks: Path) -> None:
    seed = Path(tempfile.mkdtemp(prefix="ranks-"))  # only the rank files: not the DCP folder beside them
    try:
        for name in ("rank0.pt", "rank1.pt"):
            shutil.copy(ranks / name, seed / name)

        @FUZZ
        @given(rank_edits())
        def run(edits: list[tuple[int, int, str, Any]]) -> None:
            _run(seed, _edit_ranks(edits), _check_ranks)

        @FUZZ
        @given(byte_edits(seed))
        def run_bytes(edit: Callable[[Path], None]) -> None:
            _run(seed, edit, _check_ranks)

        run()
        run_bytes()
    finally:
        shutil.rmtree(seed)


def test_the_seeds_pass_untouched(folders: dict[str, Path], ranks: Path) -> None:
    """The unedited folders convert: the checks above are not vacuous."""
    for kind, folder in folders.items():
        _check_folder(folder, kind, codes=(0,))
    _check_ranks(ranks, codes=(0,))


def test_a_zip_comment_length_past_the_end_is_named_so(folders: dict[str, Path], tmp_path: Path) -> None:
    """Found by the byte edits: a flipped comment length read "-256 bytes follow the zip end record"."""
    data = bytearray((folders["accelerate"] / "optimizer.bin").read_bytes())
    data[-2:] = (256).to_bytes(2, "little")  # torch.save writes no comment: the end record's last 2 bytes
    bad = tmp_path / "optimizer.bin"
    bad.write_bytes(bytes(data))
    result = CliRunner().invoke(cli, ["inspect", str(bad)])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "comment (256 bytes) runs past the end of the file" in result.output, result.output
