"""Faithful to every file torch and safetensors can write: dtypes, CRC-less saves, odd keys, layouts, devices.

Every input is made by torch itself. A dtype torch can save is either carried bit for bit (``ckptfix.load``,
``inspect``, ``convert`` to .pt on both paths) or refused with exit 2 and one line saying it is not supported
yet; never called corrupt.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptfix
from ckptfix.cli import cli
from tests.writers import save_without_crcs, torch_saves, without_crcs

pytestmark = [
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor"),
    pytest.mark.filterwarnings("ignore:TypedStorage is deprecated"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
]

# dtypes torch.save writes as plain bytes (torch has no arithmetic for most of them)
BYTE_DTYPES = tuple(
    name
    for name in ("complex32", "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2")
    if torch_saves(name)  # those this torch has and saves
)
# the sub-byte quantized dtypes, packing 2 or 4 values a byte (qint8 and the others were carried already)
QUANTIZED = ("quint4x2", "quint2x4")


def _random(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (made as bytes: torch cannot draw most of these dtypes)."""
    width = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    g = torch.Generator().manual_seed(n * width)
    return torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def _quantized(name: str) -> torch.Tensor:
    return torch.quantize_per_tensor(torch.arange(7.0), 0.5, 1, getattr(torch, name))


def make(name: str) -> dict[str, torch.Tensor]:
    if name.startswith("q"):
        return {"q": _quantized(name)}
    w = _random(getattr(torch, name), (4, 6))
    return {"w": w, "view": w[1:, 2:5], "t": w.t()}  # a view with an offset and strides, a transposed one


def raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes as they are stored (torch.equal has no kernels for most of these dtypes)."""
    if t.is_quantized:  # the storage: quint4x2 packs two values a byte
        return bytes(t.untyped_storage())
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def assert_bits(got: dict[str, Any], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, t in want.items():
        g = got[key]
        assert (g.dtype, g.shape, g.stride(), g.storage_offset()) == (t.dtype, t.shape, t.stride(), t.storage_offset())
        assert raw(g) == raw(t), key
        if t.is_quantized:
            assert (g.q_scale(), g.q_zero_point()) == (t.q_scale(), t.q_zero_point())


def _load(src: Path, tmp: Path) -> dict[str, Any]:
    return ckptfix.load(src)  # type: ignore[no-any-return]


def _convert(fast: bool) -> Callable[[Path, Path], dict[str, Any]]:
    def run(src: Path, tmp: Path) -> dict[str, Any]:
        out = tmp / "out.pt"
        ckptfix.convert_file(src, out, to=None, fast=fast)
        return torch.load(out, weights_only=True)  # type: ignore[no-any-return]

    return run


def _cli_convert(src: Path, tmp: Path) -> dict[str, Any]:
    out = tmp / "cli.pt"
    result = CliRunner().invoke(cli, ["convert", str(src), str(out), "--keep-layout"])
    assert result.exit_code == 0, result.output
    return torch.load(out, weights_only=True)  # type: ignore[no-any-return]


PATHS = {"load": _load, "convert-fast": _convert(True), "convert-torch": _convert(False), "cli-convert": _cli_convert}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", BYTE_DTYPES + QUANTIZED)
def test_every_dtype_torch_saves_is_carried_bit_for_bit(tmp_path: Path, name: str, path: str) -> None:
    src = tmp_path / f"{name}.pt"
    state = make(name)
    torch.save(state, src)
    assert_bits(torch.load(src, weights_only=True), state)  # what torch itself reads back
    assert_bits(PATHS[path](src, tmp_path), state)


@pytest.mark.parametrize("name", BYTE_DTYPES + QUANTIZED)
def test_inspect_shows_every_dtype_torch_saves_with_its_byte_size(tmp_path: Path, name: str) -> None:
    src = tmp_path / f"{name}.pt"
    state = make(name)
    torch.save(state, src)
    result = CliRunner().invoke(cli, ["inspect", str(src), "--json"])
    assert result.exit_code == 0, result.output
    model = json.loads(result.output)["models"][""]
    assert model["dtypes"] == {name: len(state)}
    per_byte = {"quint4x2": 2, "quint2x4": 4}.get(name, 1)  # 7 values of quint4x2 take 4 bytes
    assert model["bytes"] == sum(-(-t.numel() // per_byte) * t.element_size() for t in state.values())


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "torch-path"])
@pytest.mark.parametrize("name", (*BYTE_DTYPES, *QUANTIZED, "qint8"))
def test_a_dtype_safetensors_has_no_code_for_is_refused_in_one_line(tmp_path: Path, name: str, fast: bool) -> None:
    src, out = tmp_path / f"{name}.pt", tmp_path / "out.safetensors"
    torch.save({"w": make(name)[next(iter(make(name)))]}, src)
    result = CliRunner().invoke(cli, ["convert", str(src), str(out), *([] if fast else ["--no-fast"])])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1
    assert f"not supported yet: dtype {name}" in result.output
    assert "corrupt" not in result.output
    assert not out.exists()


# -- inspect, load_into and validate never fail with an internal error (exit 3) --------------------------------


def _inspect(path: Path, *args: str) -> Any:
    result = CliRunner().invoke(cli, ["inspect", str(path), *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output) if "--json" in args else result.output


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_inspect_groups_zero_padded_keys_keeping_their_width(tmp_path: Path, fmt: str) -> None:
    from safetensors.torch import save_file

    state = {f"layer.{i:05d}.w": torch.ones(2) for i in range(12)}
    src = tmp_path / f"zp.{fmt}"
    torch.save(state, src) if fmt == "pt" else save_file(state, src)
    (group,) = _inspect(src, "--json")["models"][""]["groups"]
    assert (group["keys"], group["count"], group["shape"]) == ("layer.{00000..00011}.w", 12, [2])
    assert "layer.{00000..00011}.w  12 × float32 [2]" in _inspect(src)


def test_inspect_shows_keys_of_any_shape_one_group_each(tmp_path: Path) -> None:
    names = ["a{b}.c", "a,b", "x..y", "x.", ".z", "", "l.{0..2}", "m.08", "m.09", "m.10"]
    src = tmp_path / "odd.pt"
    torch.save({name: torch.ones(i + 1) for i, name in enumerate(names)}, src)
    groups = _inspect(src, "--json")["models"][""]["groups"]
    assert [g["keys"] for g in groups] == [*names[:-3], "m.{08..10}"]
    assert [g["shape"] for g in groups[:-1]] == [[i + 1] for i in range(len(names) - 3)]


SPARSE = {
    "coo": lambda t: t.to_sparse(),
    "csr": lambda t: t.to_sparse_csr(),
    "csc": lambda t: t.to_sparse_csc(),
    "bsr": lambda t: t.to_sparse_bsr((2, 2)),
    "bsc": lambda t: t.to_sparse_bsc((2, 2)),
}


@pytest.mark.parametrize("layout", list(SPARSE))
def test_inspect_shows_a_sparse_tensor_with_its_layout(tmp_path: Path, layout: str) -> None:
    sparse = SPARSE[layout](torch.eye(4, dtype=torch.float16))
    src = tmp_path / f"{layout}.pt"
    torch.save({"s": sparse, "w": torch.ones(3)}, src)
    model = _inspect(src, "--json")["models"][""]
    s, w = model["groups"]
    assert (s["keys"], s["dtype"], s["shape"], s["layout"]) == ("s", "float16", [4, 4], f"sparse_{layout}")
    assert "layout" not in w
    parts = {"coo": ("_indices", "_values"), "csr": ("crow_indices", "col_indices", "values"),
             "csc": ("ccol_indices", "row_indices", "values")}  # fmt: skip
    parts.update(bsr=parts["csr"], bsc=parts["csc"])
    stored = sum(getattr(sparse, p)().nbytes for p in parts[layout])
    assert model["bytes"] == stored + 12  # what the file holds, not the dense size
    assert f"s  float16 [4, 4] sparse_{layout}" in _inspect(src)


def _quantized_linear() -> torch.nn.Module:
    m = torch.ao.nn.quantized.Linear(4, 3)
    g = torch.Generator().manual_seed(1)
    weight = torch.quantize_per_tensor(torch.randn(3, 4, generator=g), 0.05, 0, torch.qint8)
    m.set_weight_bias(weight, torch.randn(3, generator=g))
    return m


def test_a_quantized_modules_state_dict_loads_into_it(tmp_path: Path) -> None:
    src = tmp_path / "qlinear.pt"
    source = _quantized_linear()
    torch.save(source.state_dict(), src)  # its _packed_params.dtype is a torch.dtype, not a tensor
    model = torch.ao.nn.quantized.Linear(4, 3)
    report = ckptfix.load_into(model, src)
    assert report.ok
    assert torch.equal(model.weight().int_repr(), source.weight().int_repr())
    assert torch.equal(model.bias(), source.bias())
    assert ckptfix.check(src, torch.ao.nn.quantized.Linear(4, 3)).ok


def test_validate_a_quantized_modules_state_dict(tmp_path: Path) -> None:
    src = tmp_path / "qlinear.pt"
    torch.save(_quantized_linear().state_dict(), src)
    kwargs = ["--kwargs", '{"in_features": 4, "out_features": 3}']
    ok = CliRunner().invoke(cli, ["validate", str(src), "--model", "torch.ao.nn.quantized:Linear", *kwargs])
    assert ok.exit_code == 0, ok.output
    wrong = CliRunner().invoke(cli, ["validate", str(src), "--model", "torch.nn:Linear", *kwargs])
    assert wrong.exit_code == 1, wrong.output  # a plain Linear: missing and unexpected keys, not a crash


@pytest.mark.parametrize(("value", "kind"), [(3, "int"), (torch.float32, "torch.float32"), ((1, 2), "tuple")])
def test_a_value_that_is_not_a_tensor_where_the_model_has_one_is_a_wrong_dtype(
    tmp_path: Path, value: Any, kind: str
) -> None:
    src = tmp_path / "odd.pt"
    torch.save({"weight": value, "bias": torch.zeros(2)}, src)
    report = ckptfix.check(src, torch.nn.Linear(2, 2))
    assert report.wrong_dtype == {"weight": (f"{kind} (not a tensor)", "float32")}
    with pytest.raises(ckptfix.MismatchError, match=f"'weight': {kind} \\(not a tensor\\) vs model float32"):
        ckptfix.load_into(torch.nn.Linear(2, 2), src)


# -- where tensors were saved ------------------------------------------------------------------------------------


@pytest.mark.parametrize("quantized", [False, True], ids=["described", "loaded-with-torch"])
def test_inspect_says_which_devices_the_storages_were_saved_on(tmp_path: Path, quantized: bool) -> None:
    from tests.writers import saved_as

    src = tmp_path / "mixed.pt"
    on_gpu = [torch.ones(3), torch.ones(4)]
    state = {"a": on_gpu[0], "b": on_gpu[1], "tied": on_gpu[0], "c": torch.zeros(2)}
    if quantized:  # a file ckptfix hands to torch.load: the tags still come from its description
        state["q"] = _quantized("qint8")
    with saved_as("cuda:0", only=on_gpu):
        torch.save(state, src)
    summary = _inspect(src, "--json")
    assert summary["devices"] == {"cuda:0": 2, "cpu": 1 + quantized}  # storages, not tensors: "tied" is "a"
    assert f"saved on: cuda:0 ×2, cpu ×{1 + quantized} (the device tags of its storages)" in _inspect(src)


# -- files saved without CRCs, or without their tensor bytes -----------------------------------------------------


def _zero_crcs(path: Path, names: Callable[[str], bool]) -> None:
    """Set the central-directory CRC of the records ``names`` picks to 0, as a damaged or altered file might."""
    data = bytearray(path.read_bytes())
    at = data.find(b"PK\x01\x02")
    while at >= 0:
        length = int.from_bytes(data[at + 28 : at + 30], "little")
        if names(data[at + 46 : at + 46 + length].decode()):
            data[at + 16 : at + 20] = bytes(4)
        at = data.find(b"PK\x01\x02", at + 46)
    path.write_bytes(bytes(data))


@without_crcs
@pytest.mark.parametrize("path", list(PATHS))
def test_a_file_saved_without_crcs_is_read_as_torch_reads_it(tmp_path: Path, path: str) -> None:
    src = tmp_path / "fast.pt"
    state = {"w": _random(torch.float32, (3, 5)), "b": _random(torch.bfloat16, (7,))}
    save_without_crcs(state, src)
    assert_bits(PATHS[path](src, tmp_path), state)


@without_crcs
def test_inspect_and_convert_say_no_crc_is_stored(tmp_path: Path) -> None:
    src = tmp_path / "fast.pt"
    save_without_crcs({"w": torch.ones(3)}, src)
    assert _inspect(src, "--json")["crc_stored"] is False
    assert "no CRC stored: bytes not verified" in _inspect(src)
    assert "verified: every record read (it stores no CRC to check)" in _inspect(src, "--verify")
    for fast in ([], ["--no-fast"]):
        result = CliRunner().invoke(cli, ["convert", "-v", str(src), str(tmp_path / "out.pt"), *fast, "--force"])
        assert result.exit_code == 0, result.output
        assert "no CRC stored: bytes not verified" in result.output
    assert "crc_stored" not in _inspect(tmp_path / "out.pt", "--json")  # torch.save wrote CRCs this time


@without_crcs
@pytest.mark.parametrize(
    "zeroed", ["one storage", "every storage", "all but data.pkl"], ids=lambda z: z.replace(" ", "-")
)
def test_only_a_file_with_every_crc_zero_is_read_unchecked(tmp_path: Path, zeroed: str) -> None:
    state = {"w": torch.ones(3), "b": torch.ones(2)}
    save_without_crcs(state, tmp_path / "fast.pt")
    assert_bits(ckptfix.load(tmp_path / "fast.pt"), state)  # every CRC 0, as torch writes it: read unchecked
    src = tmp_path / "altered.pt"
    torch.save(state, src)
    picks = {
        "one storage": lambda name: name.endswith("/data/1"),
        "every storage": lambda name: "/data/" in name,
        "all but data.pkl": lambda name: not name.endswith("data.pkl"),
    }
    _zero_crcs(src, picks[zeroed])
    for args in (["convert", str(src), str(tmp_path / "out.pt")], ["inspect", "--verify", str(src)]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2, result.output
        assert "fails its CRC check (stored 00000000" in result.output
    with pytest.raises(ckptfix.FormatError, match="fails its CRC check"):
        ckptfix.load(src)


@pytest.mark.skipif(
    not hasattr(torch.serialization, "skip_data"), reason=f"torch {torch.__version__} has no serialization.skip_data"
)
def test_a_file_saved_under_skip_data_is_refused_as_what_it_is(tmp_path: Path) -> None:
    src = tmp_path / "skipped.pt"
    with torch.serialization.skip_data():
        torch.save({"w": torch.ones(3), "b": torch.ones(2)}, src)
    message = "saved with skip_data: no tensor bytes"
    for args in (["inspect", str(src)], ["convert", str(src), str(tmp_path / "out.pt")], ["convert", "--no-fast",
                 str(src), str(tmp_path / "out.safetensors")]):  # fmt: skip
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2, result.output
        assert message in result.output and "CRC" not in result.output
        assert result.output.count("\n") == 1
    with pytest.raises(ckptfix.FormatError, match=message):
        ckptfix.load(src)
