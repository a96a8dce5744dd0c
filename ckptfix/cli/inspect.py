"""``ckptfix inspect``: what a checkpoint holds, for people or (``--json``) for programs."""

from __future__ import annotations

from typing import Any

import click

from ckptfix.cli.options import json_option, safety_options
from ckptfix.cli.render import Output, echo, printable
from ckptfix.formats.registry import folder_format
from ckptfix.units import human_bytes

_FOLDERS = {
    "shards": "folder",
    "accelerate": "accelerate save_state folder",
    "dcp": "torch.distributed.checkpoint folder",
    "deepspeed": "DeepSpeed ZeRO run folder",
}


def _described(summary: dict[str, Any]) -> tuple[str, list[str]] | None:
    """What a folder's registry row says of it (``Format.describe``): the words for its format, and its lines."""
    folder = summary.get("folder")
    row = folder_format(folder["kind"]) if folder is not None else None
    return row.describe(summary) if row is not None and row.describe is not None else None


def _format(summary: dict[str, Any]) -> str:
    folder = summary.get("folder")
    if folder is None:
        return str(summary["format"])
    if (said := _described(summary)) is not None:
        return said[0]
    data = [f for f in folder["files"] if f != folder["index"] and f != ".metadata"]
    what = "shard" if folder["kind"] == "shards" else "data file" if folder["kind"] == "dcp" else "file"
    if folder["kind"] == "deepspeed":
        ds = summary["deepspeed"]
        return (
            f"{_FOLDERS['deepspeed']}, ZeRO-{ds['stage']} on {ds['world_size']} ranks "
            f"({len(data)} files in {ds['tag']}/)"
        )
    index = f" and index {folder['index']}" if folder["index"] else ""
    name = _FOLDERS.get(folder["kind"], f"{folder['kind']} folder")
    return f"{name} ({len(data)} {what}{'s' * (len(data) != 1)}{index})"


SHAPES_SHOWN = 4  # distinct shapes a group line lists before it counts the rest (--json has them all)


def _shapes(shapes: list[list[int]]) -> str:
    """``[16, 8, 3, 3], [32, 16, 3, 3]``: a group's distinct shapes, the first few, then how many more."""
    shown = ", ".join(str(shape) for shape in shapes[:SHAPES_SHOWN])
    more = len(shapes) - SHAPES_SHOWN
    return shown + (f", … {more} more shape{'s' * (more != 1)}" if more > 0 else "")


def _render(summary: dict[str, Any], *, max_groups: int) -> list[str]:
    lines = [
        f"{summary['path']}: {_format(summary)} {summary['kind']}, {human_bytes(summary['file_bytes'])}",
    ]
    if "dtensor" in summary:
        where = summary["dtensor"]
        lines.append(
            f"DTensor shards: one rank's part (mesh coordinate {where['coordinate']}, {where['sharding']}) of an FSDP2 "
            f"or tensor-parallel run; shapes and sizes below are the full tensors'. Reassemble every rank's file "
            f"with: ckptfix merge rank0.pt … rankN.pt -o full.safetensors"
        )
    if "deepspeed" in summary:
        lines += _deepspeed_lines(summary["deepspeed"])
    if (said := _described(summary)) is not None:
        lines += [printable(line) for line in said[1]]
    if "deepspeed_module_file" in summary:
        lines.append(f"DeepSpeed: {summary['deepspeed_module_file']['note']}")
    if "loaded_with_torch" in summary:
        lines.append(f"loaded with torch: {summary['loaded_with_torch']}")
    for name, model in summary["models"].items():
        label = f"model entry '{name}'" if name else "state dict"
        dtypes = ", ".join(f"{d} ×{n}" for d, n in model["dtypes"].items())
        lines.append(
            f"{label}: layout {model['layout']}, {model['tensors']} tensors, {model['parameters']:,} parameters"
            f"{_tied(model['tied'])}, {human_bytes(model['bytes'])} ({dtypes})"
        )
        if model.get("fsdp1_flat_params"):
            lines.append(
                f"  FSDP1 flat parameters: {', '.join(model['fsdp1_flat_params'])}: one rank's 1-D slice of many "
                f"parameters joined, which no model loads; save a full state dict instead"
            )
        if model["batchnorm_buffers"]:
            lines.append(
                f"  BatchNorm statistics: {model['batchnorm_buffers']} buffers in {model['batchnorm_modules']} modules"
            )
        for group in model["shared_storage"]:
            lines.append(f"  shared storage: {', '.join(group)}")
        if model["non_tensor_keys"]:
            lines.append(f"  non-tensor values: {', '.join(model['non_tensor_keys'])}")
        groups = model["groups"]
        # the column fits the groups up to 100 characters; a wider one gets a line of its own
        width = max((n for g in groups if (n := len(printable(g["keys"]))) <= 100), default=0)
        for group in groups[:max_groups]:
            shape = _shapes(group["shapes"])
            count = f"{group['count']} × " if group["count"] > 1 else ""
            keys = printable(group["keys"])
            if len(keys) > width:  # a group wider than the column: its details on a line of their own, aligned
                lines.append(f"  {keys}")
                keys = ""
            line = f"  {keys:<{width}}  {count}{group['dtype']} {shape}"
            if "layout" in group:
                line += f" {group['layout']}"
            if "chunking" in group or "sharding" in group:  # DCP: where its chunks are; DTensor: its placement
                line += f"  ({group.get('chunking') or group.get('sharding')})"
            lines.append(line)
        if len(groups) > max_groups:
            lines.append(f"  … {len(groups) - max_groups} more groups (--all shows them)")
    for key, text in summary["other_entries"].items():
        lines.append(f"entry '{key}': {text}")
    if "devices" in summary:
        where = ", ".join(f"{tag} ×{n}" for tag, n in summary["devices"].items())
        lines.append(f"saved on: {where} (the device tags of its storages)")
    if summary.get("crc_stored") is False:
        lines.append("no CRC stored: bytes not verified (saved with torch's compute_crc32=False)")
    if summary.get("verified") == "crc":
        lines.append("verified: every record read, every CRC matches")
    elif "verified" in summary and summary.get("crc_stored") is False:
        lines.append("verified: every record read (it stores no CRC to check)")
    elif "verified" in summary:
        lines.append("verified: every byte read (this format holds no checksums)")
    else:  # a flipped byte or a bad CRC passes a look at the headers: say so
        lines.append("tensor bytes not read: --verify, `ckptfix validate` or `ckptfix convert` check them")
    return lines


def _tied(tied: dict[str, str]) -> str:
    """`` (lm_head.weight shares transformer.wte.weight's storage)``: why the parameters count a tensor once."""
    said = [f"{copy} shares {kept}'s storage" for copy, kept in list(tied.items())[:2]]
    more = f"; and {len(tied) - 2} more" if len(tied) > 2 else ""
    return f" ({'; '.join(said)}{more})" if tied else ""


def _deepspeed_lines(ds: dict[str, Any]) -> list[str]:
    origins = ", ".join(f"{n} {what}" for what, n in ds["origins"].items())
    lines = [
        f"DeepSpeed {ds['ds_version'] or '(version unknown)'}: trained in {ds['train_dtype']}, master weights "
        f"{ds['master_dtype']}; consolidated: {ds['parameters']:,} parameters, buffers left out and tied ones "
        f"counted once ({origins} tensors)",
    ]
    lines += [f"  {printable(name)}: {holds}" for name, holds in ds["files"].items()]
    lines += [f"  note: {note}" for note in ds["notes"]]
    return lines


@click.command()
@click.argument("path", type=click.Path())
@json_option("Print one JSON object for programs.")
@click.option("--all", "show_all", is_flag=True, help="Show every key group, however many.")
@click.option("--verify", is_flag=True, help="Also read every record and check its CRC (reads the whole file).")
@safety_options
def inspect(
    path: str, output: Output, show_all: bool, verify: bool, allow_globals: tuple[str, ...], unsafe_pickle: bool
) -> None:
    """Show format, layout, sizes, dtypes, BatchNorm buffers, shared storage and grouped keys of PATH.

    Reads only the file's description (the pickle, inertly, or the safetensors header): no tensor byte, and
    torch is not imported, so any size takes a moment. --verify reads everything and checks every CRC.

    PATH may be a folder or its index file: transformers shards (model.safetensors.index.json,
    pytorch_model.bin.index.json), an accelerate save_state folder (model files as model entries, optimizer,
    scheduler and RNG files as other entries) or a torch.distributed.checkpoint folder (with how each tensor is
    chunked across its data files).

    \b
    Example: ckptfix inspect run/last.pt --json | jq .models
    Example: ckptfix inspect checkpoints/step-1000/    (a DCP or accelerate folder)
    """
    from ckptfix.summary import summarize

    summary = summarize(path, allow_globals=allow_globals, unsafe=unsafe_pickle, verify=verify)
    output.result(summary, lambda: _text(summary, max_groups=10**9 if show_all else 60))


def _text(summary: dict[str, Any], *, max_groups: int) -> None:
    for line in _render(summary, max_groups=max_groups):
        echo(line)


COMMANDS: list[click.Command] = [inspect]
