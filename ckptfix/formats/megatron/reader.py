"""Megatron-Core ``dist_checkpointing`` folders (the ``torch_dist`` backend; NeMo 2 and Megatron-Bridge write the
same), read without Megatron, Transformer Engine or CUDA, and without running a pickle.

Such a folder is a DCP folder (``.metadata``, ``__R_S.distcp``) plus ``metadata.json`` (which backend wrote it) and
``common.pt`` (what every rank holds alike: Megatron-LM's ``args``, the iteration). Its tensors are DCP global
tensors, already whole whatever the tensor, pipeline or expert parallelism; what differs from a model's own state
dict is that the transformer layers are stacked along a leading layer axis (``decoder.layers.self_attention.
linear_qkv.weight`` ``[layers, …]``), and the experts of a mixture-of-experts layer along a second one
(``decoder.layers.mlp.experts.experts.linear_fc1.weight`` ``[layers, experts, …]``). Each layer (and expert) is a
chunk of its own in the metadata, so each unstacked tensor is a :class:`~.dcp.DcpTensor` of the chunks of its
layer: its bytes are found, checked and copied by the DCP rules, nothing read here.

Names are the checkpoint's own, unstacked (``decoder.layers.0.self_attention.linear_qkv.weight``,
``decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight``): what a TP=1, PP=1 ``GPTModel`` with Megatron's
default (Transformer Engine) layer spec holds in its ``state_dict()``, norms fused into ``linear_qkv`` and
``linear_fc1`` (``layer_norm_weight``). Left out, and said: ``_extra_state`` entries (Transformer Engine's FP8
metadata, pickled objects), per-rank objects (``rng_state``), and the optimizer's state.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ckptfix.errors import FormatError
from ckptfix.formats.dcp.reader import METADATA, Chunk, DcpTensor, TensorEntry, read_dcp
from ckptfix.formats.pickles import inert
from ckptfix.formats.records import FolderRecords
from ckptfix.formats.safety import allowlist
from ckptfix.formats.strict_json import Said, json_object

METADATA_JSON = "metadata.json"
COMMON = "common.pt"
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's, in its save folder beside the iter_* folders
BACKEND = "torch_dist"
_MAX_JSON = 1 << 20
_MAX_COMMON = 1 << 30
_LAYERS = "decoder.layers."
# a stacked layer tensor, under any prefix (a wrapped model's ``module.``, NeMo's ``model.``): prefix, rest
_STACKED = re.compile(r"((?:[^./]+\.)*?)decoder\.layers\.(.+)")
_EXPERTS = "mlp.experts.experts."  # stacked as [layer, expert, …]: SequentialMLP's local_experts.N once unstacked
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp")
# The model arguments inspect shows, by Megatron-LM's names (an HF export reads them all:
# ckptfix.exporting.megatron_args).
_ARGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "group_query_attention",
    "kv_channels",
    "padded_vocab_size",
    "max_position_embeddings",
    "normalization",
    "swiglu",
    "position_embedding_type",
    "untie_embeddings_and_output_weights",
    "num_experts",
    "moe_router_topk",
    "params_dtype",
    "bf16",
    "fp16",
    # what an HF config is built from (ckptfix.exporting.megatron), and what it refuses
    "norm_epsilon",
    "rotary_base",
    "rotary_percent",
    "rotary_interleaved",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "vocab_size",
    "moe_ffn_hidden_size",
    "moe_router_pre_softmax",
    "moe_router_score_function",
    "moe_shared_expert_intermediate_size",
    "moe_layer_freq",
    "rope_scaling",
    "use_rope_scaling",
    "layernorm_epsilon",
    "apply_layernorm_1p",
    "layernorm_zero_centered_gamma",
)
_LAYOUT = {
    "tensor": "tensor_model_parallel_size",
    "pipeline": "pipeline_model_parallel_size",
    "virtual_pipeline": "virtual_pipeline_model_parallel_size",
    "expert": "expert_model_parallel_size",
    "context": "context_parallel_size",
}


@dataclass
class Megatron:
    """A checked ``torch_dist`` folder: the model's tensors unstacked, by name; what ``common.pt`` says."""

    root: str
    state: dict[str, DcpTensor]
    args: dict[str, Any]  # common.pt's args (plain values; other objects by their name)
    layout: dict[str, int]  # parallel sizes, as common.pt's args say them
    ranks: int  # the ranks that wrote data files
    common: dict[str, Any]  # common.pt's other plain entries (iteration, checkpoint_version)
    files: list[str]
    notes: list[str] = field(default_factory=list)
    under: list[str] = field(default_factory=list)  # the prefixes its stacked layers were found under ('' for none)

    @property
    def kind(self) -> str:
        """``Megatron-Core torch_dist (TP 2, PP 1, EP 1)``: the folder, in the words of ``convert -v``."""
        sizes = ", ".join(
            f"{k} {self.layout[v]}"
            for k, v in (("TP", "tensor"), ("PP", "pipeline"), ("VPP", "virtual_pipeline"), ("EP", "expert"))
            if v in self.layout
        )
        return f"Megatron-Core {BACKEND}" + (f" ({sizes})" if sizes else f" ({self.ranks} ranks)")

    def summary(self) -> dict[str, Any]:
        """What ``inspect`` shows: the layout, the model arguments, the tensor count, what is left out."""
        shown = {k: self.args[k] for k in _ARGS if k in self.args}  # the model's
        return {
            "backend": BACKEND,
            "layout": dict(self.layout),
            "ranks": self.ranks,
            "args": shown,
            "tensors": len(self.state),
            "unstacked_under": list(self.under),
            **self.common,
            "notes": list(self.notes),
        }


def is_megatron(path: str) -> bool:
    """A folder with Megatron's ``metadata.json`` (a ``sharded_backend`` named; which one, :func:`describe` checks),
    or Megatron-LM's save folder (its ``latest_checkpointed_iteration.txt`` naming an ``iter_*`` folder). Beside a
    DCP ``.metadata`` the file must be Megatron's: a damaged one is refused, not read as plain DCP."""
    if not os.path.isdir(path):
        return False
    if not os.path.isfile(os.path.join(path, METADATA_JSON)):
        return os.path.isfile(os.path.join(path, TRACKER))
    try:
        return "sharded_backend" in _metadata_json(path)
    except FormatError:
        if os.path.isfile(os.path.join(path, METADATA)):
            raise
        return False  # another tool's metadata.json, in a folder that is no DCP folder


def resolve(path: str) -> str:
    """The iteration folder Megatron-LM's tracker file names in its save folder (``iter_0000100``, ``release``), or
    ``path`` itself when it is the checkpoint."""
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(os.path.join(path, METADATA_JSON)) or not os.path.isfile(tracker):
        return path
    with open(tracker, "rb") as f:
        raw = f.read(65)
    said = raw.decode("ascii", "replace").strip()
    if len(raw) > 64 or not (said.isdigit() or said == "release"):
        raise FormatError(
            f"{tracker}: says {said[:64]!r}, not an iteration number or 'release'; the file is damaged: "
            f"pass the iter_* folder itself"
        )
    folder = os.path.join(path, "release" if said == "release" else f"iter_{int(said):07d}")
    if not os.path.isdir(folder):
        raise FormatError(
            f"{tracker}: names iteration {said}, but {folder} is not there; copy it, or pass the iter_* folder to read"
        )
    if not os.path.isfile(os.path.join(folder, METADATA_JSON)):
        raise FormatError(
            f"{folder}: a Megatron-LM checkpoint without metadata.json (the legacy per-rank format, "
            f"mp_rank_*/model_optim_rng.pt); ckptfix reads '{BACKEND}' folders: re-save with "
            f"--ckpt-format torch_dist"
        )
    return folder


def _metadata_json(root: str) -> dict[str, Any]:
    source = os.path.join(root, METADATA_JSON)
    with open(source, "rb") as f:
        raw = f.read(_MAX_JSON + 1)
    if len(raw) > _MAX_JSON:
        raise FormatError(f"{source}: over 1 MiB; Megatron's metadata.json is a few lines: it is damaged")
    said = Said(
        duplicate="{e}; the file is damaged",
        invalid="not JSON ({e}); the file is damaged",
        not_object="not a JSON object; the file is damaged",
    )
    return json_object(raw, source=source, said=said)


def describe(root: str, *, allow_globals: Any = ()) -> Megatron:
    """Read and check the folder: ``metadata.json``, ``common.pt`` and ``.metadata`` (its plan: every chunk inside
    its tensor, the chunks tiling it, each span inside a data file, as every DCP folder's), then the layer axes
    unstacked. No tensor byte is read. ``root`` may be Megatron-LM's save folder: the iteration its tracker file
    names is read."""
    top, root = root, resolve(root)
    meta = _metadata_json(root)
    source = os.path.join(root, METADATA_JSON)
    backend = meta.get("sharded_backend")
    if backend != BACKEND:
        raise FormatError(
            f"{source}: a Megatron-Core checkpoint of sharded backend {backend!r}; ckptfix reads "
            f"'{BACKEND}': convert it with Megatron (--ckpt-format torch_dist) first"
        )
    if not os.path.isfile(os.path.join(root, METADATA)):
        raise FormatError(f"{os.path.join(root, METADATA)}: missing; a torch_dist folder has one: copy it again")
    common = _common(root, allow_globals=allow_globals)
    args = common.pop("args", {})
    d = read_dcp(root)
    notes: list[str] = []
    extra = [k for k in d.values if k.rpartition("/")[0].endswith("_extra_state")]
    others = sorted(k for k in d.values if k not in extra)
    optimizer = [k for k in d.tensors if k.startswith("optimizer.")]
    if extra:
        notes.append(f"{len(extra)} _extra_state entries left out (Transformer Engine's FP8 metadata, pickled)")
    if others:
        names = ", ".join(sorted({k.split("/")[0] for k in others}))
        notes.append(f"{len(others)} per-rank objects left out ({names})")
    if optimizer:
        notes.append(
            f"the optimizer's state ({len(optimizer)} tensors) left out: ckptfix converts the model of a "
            f"Megatron checkpoint only"
        )
    state: dict[str, DcpTensor] = {}
    for key, entry in d.tensors.items():
        if key.startswith("optimizer."):
            continue
        for name, part in _unstacked(key, entry, args=args, source=os.path.join(root, METADATA)):
            if name in state or (name != key and name in d.tensors):
                raise FormatError(
                    f"{os.path.join(root, METADATA)}: '{name}' is stored both stacked and on its own; "
                    f"the metadata is damaged or crafted"
                )
            state[name] = DcpTensor(name, part)
    ranks = {int(m.group(1)) for f in d.files if (m := _RANK_FILE.fullmatch(os.path.basename(f)))}
    files = [os.path.join(root, n) for n in (METADATA_JSON, COMMON, METADATA)]
    if top != root:
        files.insert(0, os.path.join(top, TRACKER))
    layout = {k: v for k, name in _LAYOUT.items() if type(v := args.get(name)) is int}
    under = sorted({p for k in d.tensors if (p := stacked_under(k)) is not None and not k.startswith("optimizer.")})
    return Megatron(
        root=root,
        state=state,
        args=args,
        layout=layout,
        ranks=len(ranks),
        common=common,
        files=[f for f in files if os.path.isfile(f)] + sorted(d.files),
        notes=notes,
        under=under,
    )


def _common(root: str, *, allow_globals: Any) -> dict[str, Any]:
    """``common.pt`` read inertly: its plain entries, and ``args`` (an ``argparse.Namespace``) as a dict of plain
    values. Objects of other classes (Megatron's enums, dtypes) are kept as their class's name, never built; a
    pickle naming anything that can run code is refused."""
    from ckptfix.formats.torchzip.reader import read_torch_zip

    source = os.path.join(root, COMMON)
    if not os.path.isfile(source):
        return {}
    allowed = allowlist.allowed_names(["argparse.Namespace", *allow_globals], source=source)
    refused: list[str] = []
    fd = os.open(source, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size > _MAX_COMMON:
            raise FormatError(f"{source}: over 1 GiB; Megatron's common.pt holds arguments, not weights")
        tree = read_torch_zip(fd, source, allowed=allowed, verify=True, refused=refused).tree
    finally:
        os.close(fd)
    # the other classes it names stay inert records (Megatron's enums in args); one that can run code is refused
    allowlist.refuse([n for n in refused if allowlist.can_run_code(n)], source=source)
    if not isinstance(tree, dict):
        raise FormatError(f"{source}: holds a {type(tree).__name__}, not Megatron's dict of common values")
    out: dict[str, Any] = {}
    for key in ("iteration", "checkpoint_version"):
        if isinstance(tree.get(key), (int, float, str)):
            out[key] = tree[key]
    args = tree.get("args")
    if isinstance(args, inert.Inert) and args.func.full == "argparse.Namespace" and isinstance(args.state, dict):
        out["args"] = {str(k): _plain(v) for k, v in args.state.items()}
    return out


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, type) and issubclass(value, inert.Global):  # a dtype or a class named: its name
        return value.full.removeprefix("torch.")
    if isinstance(value, inert.Inert):  # an enum member or an object: its class, not built
        return value.func.full
    if isinstance(value, (list, tuple)) and all(v is None or isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    return type(value).__name__


def stacked_under(key: str) -> str | None:
    """The prefix (``''``, ``'module.'``) under which ``key`` names a stacked layer tensor, or None: it is not one."""
    m = _STACKED.fullmatch(key)
    return None if m is None or m.group(2).split(".", 1)[0].isdigit() else m.group(1)


def _unstacked(key: str, entry: TensorEntry, *, args: dict[str, Any], source: str) -> list[tuple[str, TensorEntry]]:
    """The tensors of ``key`` by name: itself, or one per layer (and expert) of a stacked tensor, each of the chunks
    of its layer. Megatron writes each layer (and expert) as chunks of extent 1 along the stacked axes; the tiling
    of the whole was proven by :func:`~.dcp.read_dcp`, so the chunks of one layer tile that layer exactly."""
    if (prefix := stacked_under(key)) is None:
        return [(key, entry)]
    rest = key[len(prefix) + len(_LAYERS) :]
    n = 2 if rest.startswith(_EXPERTS) or ("." + _EXPERTS) in rest else 1
    if len(entry.shape) < n:
        raise FormatError(
            f"{source}: '{key}' is {list(entry.shape)}, not stacked by layer{' and expert' * (n - 1)}; "
            f"the metadata is damaged"
        )
    for axis, claim in zip(range(n), ("num_layers", "num_experts"), strict=False):
        said = args.get(claim)
        if type(said) is int and said != entry.shape[axis]:
            raise FormatError(
                f"{source}: '{key}' stacks {entry.shape[axis]} along its {claim} axis but common.pt's "
                f"args say {claim}={said}; the folder mixes two checkpoints: copy it again"
            )
    if (count := math.prod(entry.shape[:n])) > len(entry.chunks):  # each layer is a chunk at least, even empty
        raise FormatError(
            f"{source}: '{key}' stacks {count} layers{' and experts' * (n - 1)} in "
            f"{len(entry.chunks)} chunks; Megatron stores one layer per chunk: the metadata is damaged "
            f"or crafted"
        )
    slabs: dict[tuple[int, ...], list[Chunk]] = {}
    for c in entry.chunks:
        if any(s != 1 for s in c.sizes[:n]):
            raise FormatError(
                f"{source}: '{key}' has a chunk at {list(c.offsets)} of size {list(c.sizes)} "
                f"spanning several layers; Megatron stores one layer per chunk: the metadata is "
                f"damaged"
            )
        slabs.setdefault(c.offsets[:n], []).append(
            Chunk(c.offsets[n:], c.sizes[n:], c.span, stored=c.sizes if c.stored is None else c.stored)
        )
    out = []
    for index in itertools.product(*(range(d) for d in entry.shape[:n])):
        name = f"{prefix}{_LAYERS}{index[0]}.{rest}"
        if n == 2:
            name = name.replace(_EXPERTS, f"mlp.experts.local_experts.{index[1]}.", 1)
        out.append((name, TensorEntry(entry.dtype, entry.shape[n:], tuple(slabs.get(index, ())))))
    return out


def load_megatron(root: str, *, allow_globals: Any = ()) -> dict[str, Any]:
    """The model of a ``torch_dist`` folder as torch tensors by Megatron's names (a TP=1, PP=1 state dict), one
    tensor at a time from its chunks, each chunk's archive checked (its pickle, its CRCs) as a ``.pt`` file's."""
    from ckptfix.formats.dcp.reader import read_dcp_tensor
    from ckptfix.formats.files import DataFiles
    from ckptfix.formats.hf.folder import room_for_files

    run = describe(root, allow_globals=allow_globals)
    room_for_files(len(run.files), source=root)
    allowed = allowlist.allowed_names(allow_globals, source=root)
    files = DataFiles()
    try:
        out = {name: read_dcp_tensor(t, files.fd, allowed=allowed) for name, t in run.state.items()}
        files.check_unchanged()
    finally:
        files.close()
    return out


def records(root: str, *, allow_globals: Any = ()) -> FolderRecords:
    """The folder's model as :class:`~.dcp.DcpTensor` records (its registry row's ``records``: what ``inspect``,
    ``diff`` and the streaming writers read), its kind in words and what ``inspect`` shows; no tensor byte read."""
    run = describe(root, allow_globals=allow_globals)
    return FolderRecords(tree=run.state, kind=run.kind, files=run.files, notes=run.notes, summary=run.summary())


def describe_summary(summary: dict[str, Any]) -> tuple[str, list[str]]:
    """What ``inspect`` says of the folder (its registry row's ``describe``): its format in words (its data files
    counted: beside them the plan, metadata.json, common.pt, the tracker file), and its lines."""
    data = [f for f in summary["folder"]["files"] if f.endswith(".distcp")]
    mg = summary["megatron"]
    layout = ", ".join(f"{k.replace('_', ' ')} parallel {v}" for k, v in mg["layout"].items())
    args = ", ".join(f"{k}={v}" for k, v in mg["args"].items())
    step = f", iteration {mg['iteration']}" if "iteration" in mg else ""
    layout = layout or "parallel sizes not recorded"
    ranks = f"{mg['ranks']} rank{'s' * (mg['ranks'] != 1)}"
    under = mg.get("unstacked_under", [])
    said = " under " + ", ".join(repr(p) for p in under) if any(under) else ""
    stacked = f"layers unstacked{said}" if under else "no stacked layers"
    lines = [f"Megatron-Core: {layout}; written by {ranks}{step}; {mg['tensors']} tensors, {stacked}"]
    lines += [f"  args: {args}"] if args else []
    lines += [f"  note: {note}" for note in mg["notes"]]
    return f"Megatron-Core {BACKEND} folder ({len(data)} data file{'s' * (len(data) != 1)})", lines
