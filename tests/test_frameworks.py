"""Checkpoints written by the libraries people train with, made here with those libraries, read by ckptfix.

transformers (a GPT-2 whose ``lm_head`` is tied to ``wte``), timm (a ``CheckpointSaver`` file with an EMA copy and
``args`` as an ``argparse.Namespace``), Lightning (a ``.ckpt`` from ``Trainer.fit`` whose hparams hold a
``pathlib.Path``) and mmengine (a Runner checkpoint whose ``message_hub`` pickles ``builtins.getattr`` calls). Each
time the weights ckptfix loads are compared, ``torch.equal``, with what the library's own loader gives. Each test
skips, saying why, when its library is not installed (``pip install -e '.[frameworks]'``). A marker-file payload
placed next to the weights is never run, on any entry point, while the weights are rescued.
"""

from __future__ import annotations

import argparse
import builtins
import pathlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from torch import nn

import ckptfix
from ckptfix.cli import cli
from tests.frameworks import library, mmengine_checkpoint
from tests.models import SmallNet, make_net


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _equal(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert state[key].dtype == value.dtype and torch.equal(state[key], value), key


OPEN = f"{builtins.open.__module__}.open"  # how pickle names builtins.open: io.open


class Payload:
    """Pickles as ``open(marker, "w")``: running the file's pickle creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.open, (self.marker, "w"))


def _never_runs(path: Path, marker: Path, model: nn.Module, *, extra: tuple[str, ...] = ()) -> None:
    """Every entry point refuses ``path`` (a payload inside the model state dict) as code, without advice, and the
    marker never appears."""
    calls: list[Callable[[], object]] = [
        lambda: ckptfix.load(path, allow_globals=extra),
        lambda: ckptfix.load_into(model, path, allow_globals=extra),
        lambda: ckptfix.check(path, model, allow_globals=extra),
        lambda: ckptfix.load(path, allow_globals=[*extra, OPEN]),
    ]
    for call in calls:
        with pytest.raises(ckptfix.UnsafeCheckpointError, match=re.escape(OPEN)):
            call()
        assert not marker.exists()
    flags = [w for name in extra for w in ("--allow-global", name)]
    commands: list[list[str | Path]] = [["validate", path, "--model", "tests.models:SmallNet"], ["inspect", path]]
    for args in commands:
        result = run(*args, *flags)
        assert result.exit_code == 2 and OPEN in result.stderr, result.output
        assert "--unsafe-pickle" not in result.stderr and "--allow-global" not in result.stderr
        assert not marker.exists()


def _rescued(
    path: Path,
    marker: Path,
    model: nn.Module,
    expected: dict[str, torch.Tensor],
    *,
    extra: tuple[str, ...] = (),
    factory: tuple[str, ...] = (),
) -> None:
    """The weights beside a payload (in another entry) load, check, validate and convert; the payload is named as
    code everywhere, copied only unexecuted into a full .pt copy, and the marker never appears."""
    for allow in (extra, (*extra, OPEN)):  # naming it does not allow it
        with pytest.raises(ckptfix.UnsafeCheckpointError, match=re.escape(OPEN)):
            ckptfix.load(path, allow_globals=allow)
    report = ckptfix.load_into(model, path, allow_globals=extra)
    assert (
        report.ok
        and report.not_copyable
        and any(f"{OPEN}, which can run code" in w for w in report.not_loaded.values())
    )
    _equal(model.state_dict(), expected)
    assert ckptfix.check(path, model, allow_globals=extra).not_loaded == report.not_loaded
    flags = [w for name in extra for w in ("--allow-global", name)]
    factory = factory or ("--model", f"{type(model).__module__}:{type(model).__name__}")
    result = run("validate", path, *factory, *flags)
    assert result.exit_code in (0, 1) and f"{OPEN}, which can run code" in result.stdout, result.output
    result = run("inspect", path, *flags)
    assert result.exit_code == 0 and f"{OPEN}, which can run code (nothing was run)" in result.stdout, result.output
    result = run("convert", path, path.parent / "full.pt", *flags)  # a full copy: the payload copied, never run
    assert result.exit_code == 0 and f"it calls {OPEN}, which can run code" in result.stderr, result.output
    result = run("inspect", path.parent / "full.pt", *flags)
    assert result.exit_code == 0 and f"{OPEN}, which can run code (nothing was run)" in result.stdout, result.output
    result = run("convert", path, path.parent / "weights.pt", "--model-only", *flags)  # every model entry
    assert result.exit_code == 0, result.output
    torch.load(path.parent / "weights.pt", weights_only=True)
    assert not marker.exists()


def test_a_payload_next_to_the_weights_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    path = tmp_path / "ckpt.pt"
    torch.save({"model": make_net().state_dict(), "epoch": 1, "payload": Payload(marker)}, path)
    torch.load(path, weights_only=False)["payload"].close()  # the premise: the full unpickler runs it
    assert marker.exists()
    marker.unlink()
    _rescued(path, marker, SmallNet(seed=3), make_net().state_dict())
    torch.save({**make_net().state_dict(), "payload": Payload(marker)}, path)  # in a bare state dict: all model
    _never_runs(path, marker, SmallNet())


# --- transformers: GPT-2 with tied embeddings ------------------------------------------------------------------


def tiny_gpt2() -> Any:
    """A GPT-2 small enough for a test; ``lm_head.weight`` is ``transformer.wte.weight`` (tied)."""
    transformers = library("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.slow  # importing transformers and three from_pretrained calls: about 10 s on 2 cores
def test_transformers_gpt2_tied_weights_load_as_from_pretrained_loads_them(tmp_path: Path) -> None:
    transformers = library("transformers")
    remove_tied_weights_from_state_dict = library("transformers.modeling_utils").remove_tied_weights_from_state_dict

    torch.manual_seed(0)
    model = tiny_gpt2()
    model.save_pretrained(tmp_path / "st")  # transformers 5 writes safetensors only
    (tmp_path / "bin").mkdir()
    model.config.save_pretrained(tmp_path / "bin")
    # What save_pretrained(safe_serialization=False) wrote before transformers 5, and from_pretrained still reads.
    bin_state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    torch.save(bin_state, tmp_path / "bin" / "pytorch_model.bin")
    assert "lm_head.weight" not in bin_state
    for folder, weights in (("st", "model.safetensors"), ("st", ""), ("bin", "pytorch_model.bin")):
        expected = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / folder).state_dict()
        path = tmp_path / folder / weights if weights else tmp_path / folder
        torch.manual_seed(1)
        target: Any = tiny_gpt2()
        report = ckptfix.load_into(target, path)
        assert report.tied == {"lm_head.weight": "transformer.wte.weight"} and report.loads_as_is
        _equal(target.state_dict(), expected)
        assert target.lm_head.weight is target.transformer.wte.weight  # still one tensor
        assert ckptfix.check(path, tiny_gpt2()).tied == report.tied
    result = run("validate", tmp_path / "bin" / "pytorch_model.bin", "--model", "tests.test_frameworks:tiny_gpt2")
    assert result.exit_code == 0, result.output
    assert "  lm_head.weight = transformer.wte.weight" in result.stdout
    marker = tmp_path / "PWNED"
    torch.save({**bin_state, "payload": Payload(marker)}, tmp_path / "bin" / "payload.bin")
    _never_runs(tmp_path / "bin" / "payload.bin", marker, tiny_gpt2())


# --- timm: CheckpointSaver with an EMA copy and argparse args ----------------------------------------------------


def _timm_checkpoint(tmp_path: Path, **args: Any) -> tuple[Any, Path]:
    timm = library("timm")
    utils = library("timm.utils")

    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=3)
    ema = utils.ModelEmaV3(model, decay=0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(4, 3, 32, 32)).square().mean().backward()
    optimizer.step()
    ema.update(model)  # the EMA copy now differs from the trained weights
    namespace = argparse.Namespace(model="test_resnet", lr=0.5, epochs=1, **args)
    saver = utils.CheckpointSaver(
        model, optimizer, args=namespace, model_ema=ema, checkpoint_dir=str(tmp_path), recovery_dir=str(tmp_path)
    )
    saver.save_checkpoint(epoch=0, metric=0.5)
    return timm, tmp_path / "last.pth.tar"


@pytest.mark.slow  # timm and torchvision imports, two models, a CLI run: about 5 s
def test_timm_ema_checkpoint_loads_as_timms_own_loader_loads_it(tmp_path: Path) -> None:
    timm, path = _timm_checkpoint(tmp_path)
    load_checkpoint = library("timm.models").load_checkpoint

    with pytest.raises(ckptfix.UnsafeCheckpointError, match=r"allow_globals='argparse\.Namespace'"):
        ckptfix.load(path)
    report = ckptfix.load_into(timm.create_model("test_resnet", num_classes=3), path)  # 'args' is not needed
    assert report.not_loaded == {"args": "argparse.Namespace ×1, not loaded"}
    allow = ["argparse.Namespace"]
    for use_ema, entry in ((True, "state_dict_ema"), (False, None)):
        expected = timm.create_model("test_resnet", num_classes=3)
        load_checkpoint(expected, str(path), use_ema=use_ema)  # timm's default is use_ema=True
        target = timm.create_model("test_resnet", num_classes=3)
        report = ckptfix.load_into(target, path, entry=entry, allow_globals=allow)
        assert report.entry == (entry or "state_dict") and report.loads_as_is
        _equal(target.state_dict(), expected.state_dict())
    trained, ema = (ckptfix.load(path, allow_globals=allow)[k] for k in ("state_dict", "state_dict_ema"))
    assert any(not torch.equal(trained[k], ema[k]) for k in trained)  # the two entries really differ
    result = run("validate", path, "--model", "timm:create_model", "--kwargs", '{"model_name": "test_resnet", '
                 '"num_classes": 3}', "--allow-global", "argparse.Namespace", "--entry", "state_dict_ema")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0].startswith(f"checkpoint: {path} (entry 'state_dict_ema', layout single")


@pytest.mark.slow  # importing timm and torchvision
def test_timm_payload_in_args_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    timm, path = _timm_checkpoint(tmp_path, payload=Payload(marker))
    expected = torch.load(path, weights_only=False)["state_dict"]  # the premise: the full unpickler runs it
    assert marker.exists()
    marker.unlink()
    model = timm.create_model("test_resnet", num_classes=3)
    kwargs = '{"model_name": "test_resnet", "num_classes": 3}'
    factory = ("--model", "timm:create_model", "--kwargs", kwargs)
    _rescued(path, marker, model, expected, extra=("argparse.Namespace",), factory=factory)


# --- Lightning: a .ckpt from Trainer.fit, hparams with a pathlib.Path -------------------------------------------


class TinyNet(nn.Module):
    """The network a LightningModule keeps as ``self.model``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))  # type: ignore[no-any-return]


def _lightning_fit(tmp_path: Path, **hparams: Any) -> tuple[Any, Path]:
    lightning = library("lightning")

    class Classifier(lightning.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self, data_dir: pathlib.Path, lr: float = 0.1, **extra: Any) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.model = TinyNet()

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.model(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,)))
    saver = lightning.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, filename="last")
    trainer = lightning.Trainer(
        max_epochs=1, accelerator="cpu", devices=1, logger=False, callbacks=[saver], enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(Classifier(pathlib.Path("/data/bars"), **hparams), torch.utils.data.DataLoader(data, batch_size=8))
    return Classifier, tmp_path / "last.ckpt"


@pytest.mark.slow  # importing Lightning alone takes seconds
def test_lightning_ckpt_with_a_path_in_hparams_loads_into_the_inner_network(tmp_path: Path) -> None:
    classifier, path = _lightning_fit(tmp_path)
    with pytest.raises(ckptfix.UnsafeCheckpointError, match=r"allow_globals='pathlib\.PosixPath'"):
        ckptfix.load(path)
    allow = ["pathlib.PosixPath"]
    assert ckptfix.load(path, allow_globals=allow)["hyper_parameters"]["data_dir"] == pathlib.Path("/data/bars")
    expected = classifier.load_from_checkpoint(path, weights_only=False).model.state_dict()  # Lightning's loader
    net = TinyNet()
    report = ckptfix.load_into(net, path, allow_globals=allow)
    assert report.renamed_prefix == ("model.", "") and report.entry == "state_dict"
    _equal(net.state_dict(), expected)
    assert run("inspect", path, "--allow-global", "pathlib.PosixPath").exit_code == 0
    result = run("validate", path, "--model", "tests.test_frameworks:TinyNet", "--allow-global", "pathlib.PosixPath")
    assert result.exit_code == 1 and "prefix only: the checkpoint's keys carry 'model.' in front" in result.stdout
    # Without --allow-global the hparams stay unbuilt and the weights still load and convert.
    report = ckptfix.load_into(TinyNet(), path)
    assert report.not_loaded == {"hyper_parameters": "pathlib.PosixPath ×1, not loaded"}
    out = tmp_path / "weights.safetensors"
    assert run("convert", path, out, "--model-only", "--strip-prefix", "model.").exit_code == 0
    _equal(ckptfix.load(out), expected)
    clean = tmp_path / "clean.ckpt"  # a copy plain torch opens weights-only: the path became a string
    assert ckptfix.sanitize(path, clean).dropped == []
    copy = torch.load(clean, weights_only=True)
    assert copy["hyper_parameters"]["data_dir"] == "/data/bars" and copy["epoch"] == 0
    _equal({k.removeprefix("model."): v for k, v in copy["state_dict"].items()}, expected)
    marker = tmp_path / "PWNED"
    _, poisoned = _lightning_fit(tmp_path / "poisoned", payload=Payload(marker))
    # Lightning deep-copies its hparams while it trains, and the full unpickler runs the payload again
    marker.unlink()
    trained = torch.load(poisoned, weights_only=False)["state_dict"]
    expected = {k.removeprefix("model."): v for k, v in trained.items()}
    assert marker.exists()
    marker.unlink()
    _rescued(poisoned, marker, TinyNet(), expected, extra=tuple(allow))


# --- mmengine: a Runner checkpoint, whose message_hub pickles bound methods through builtins.getattr ---------------


@pytest.mark.slow  # importing mmengine.optim takes seconds
def test_mmengine_weights_are_rescued_beside_its_message_hub(tmp_path: Path) -> None:
    path = mmengine_checkpoint(tmp_path)
    trusted = torch.load(path, weights_only=False)  # what mmengine's own loader reads (before torch 2.6's default)
    expected = SmallNet(seed=9)
    expected.load_state_dict(trusted["state_dict"])  # mmengine's load_checkpoint: load_state_dict of 'state_dict'
    with pytest.raises(ckptfix.UnsafeCheckpointError) as refused:
        ckptfix.load(path)
    message = str(refused.value)
    assert "calls builtins.getattr, which can run code" in message
    assert "The weights in 'state_dict' need none of it ('message_hub' would stay unloaded)" in message
    out = tmp_path / "w.safetensors"
    result = run("convert", path, out, "--model-only")  # the command the issue found refused
    assert result.exit_code == 0, result.output
    _equal(ckptfix.load(out), expected.state_dict())
    net = SmallNet(seed=5)
    report = ckptfix.load_into(net, path)
    hub = "mmengine.logging.history_buffer.HistoryBuffer ×2, not loaded"
    assert report.not_loaded == {"message_hub": f"{hub}; it calls builtins.getattr, which can run code (nothing "
                                                f"was run)"}  # fmt: skip
    _equal(net.state_dict(), expected.state_dict())
    result = run("inspect", path)
    assert result.exit_code == 0 and f"entry 'message_hub': {hub}" in result.stdout, result.output
    assert run("validate", path, "--model", "tests.models:SmallNet").exit_code == 0
    # sanitize: plain torch opens the copy weights-only; everything but the history buffers is kept
    clean = tmp_path / "clean.pth"
    dropped = ckptfix.sanitize(path, clean).dropped
    assert {(d.where, d.what) for d in dropped} == {
        (f"message_hub['log_scalars']['train/{name}']", "mmengine.logging.history_buffer.HistoryBuffer")
        for name in ("loss", "lr")
    }
    copy = torch.load(clean, weights_only=True)
    _equal(copy["state_dict"], expected.state_dict())
    assert copy["meta"] == trusted["meta"] and copy["param_schedulers"] == trusted["param_schedulers"]
    assert copy["message_hub"]["runtime_info"] == trusted["message_hub"]["runtime_info"]
    for key, value in trusted["optimizer"]["state"].items():
        assert torch.equal(copy["optimizer"]["state"][key]["momentum_buffer"], value["momentum_buffer"])
    # a full conversion (to resume under DDP) keeps the message hub as its records: mmengine reads it back
    ddp = tmp_path / "ddp.pth"
    result = run("convert", path, ddp, "--to", "ddp")
    assert result.exit_code == 0 and "'message_hub' (mmengine.logging.history_buffer.HistoryBuffer ×2" in result.stderr
    resumed = torch.load(ddp, weights_only=False)  # the trusted loader again, on our copy
    _equal({k.removeprefix("module."): v for k, v in resumed["state_dict"].items()}, expected.state_dict())
    hubs = resumed["message_hub"]["log_scalars"], trusted["message_hub"]["log_scalars"]
    assert hubs[0].keys() == hubs[1].keys()
    for name, buffer in hubs[1].items():
        assert [x.tolist() for x in hubs[0][name].data] == [x.tolist() for x in buffer.data]


@pytest.mark.slow  # importing mmengine.optim takes seconds
def test_mmengine_payload_in_meta_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    path = mmengine_checkpoint(tmp_path, cfg=Payload(marker))
    expected = torch.load(path, weights_only=False)["state_dict"]  # the premise: the full unpickler runs it
    assert marker.exists()
    marker.unlink()
    _rescued(path, marker, SmallNet(seed=2), expected)
