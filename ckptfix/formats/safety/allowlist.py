"""Which pickle globals a checkpoint may name: the one allowlist both paths read.

A file may name, without any option, the globals torch's weights-only unpickler accepts by default (a copy of
torch 2.13's list, so the streaming path needs no torch). ``--allow-global`` may add only names from
:data:`KNOWN_SAFE`: plain data constructors that build values and call nothing else, the ones torch documents for
``add_safe_globals``, and, named one by one, the enums, dataclasses and named tuples of the user's own code
(:func:`user_class`). Any other name is refused as "not a known-safe class", and names that can run code or reach
the system are refused with a message that never suggests an option: the advice ckptfix prints must be safe to
follow.
"""

from __future__ import annotations

import _compat_pickle
import dataclasses
import enum
import importlib
import sys
from collections.abc import Callable, Iterable
from typing import Any

from ckptfix.errors import FormatError, UnsafeCheckpointError
from ckptfix.formats.dtypes import DTYPES, STORAGE_DTYPES

_TENSOR_TYPES = ("Double", "Float", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool")
_EXOTIC_DTYPES = (
    "bits16",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "bits8",
    "complex32",
    "float4_e2m1fn_x2",
    *(f"int{i}" for i in range(1, 8)),
    *(f"uint{i}" for i in range(1, 8)),
    "per_channel_affine",
    "per_channel_affine_float_qparams",
    "per_channel_symmetric",
    "per_tensor_affine",
    "per_tensor_symmetric",
)
# torch's default weights-only allowlist (torch 2.13, torch._weights_only_unpickler._get_allowed_globals)
TORCH_DEFAULT: frozenset[str] = frozenset(
    {
        "_codecs.encode",
        "builtins.bytearray",
        "builtins.complex",
        "builtins.set",
        "collections.Counter",
        "collections.OrderedDict",
        "torch.Size",
        "torch.Tensor",
        "torch.device",
        "torch.nn.parameter.Parameter",
        "torch.serialization._get_layout",
        "torch.storage.TypedStorage",
        "torch.storage.UntypedStorage",
        "torch._tensor._rebuild_from_type_v2",
        *(
            f"torch._utils._rebuild_{f}"
            for f in (
                "device_tensor_from_cpu_tensor",
                "device_tensor_from_numpy",
                "meta_tensor_no_storage",
                "nested_tensor",
                "parameter",
                "parameter_with_state",
                "qtensor",
                "sparse_tensor",
                "tensor",
                "tensor_v2",
                "tensor_v3",
                "wrapper_subclass",
            )
        ),
        *(f"torch.{s}" for s in STORAGE_DTYPES),
        *(f"torch.{d}" for d in DTYPES),
        *(f"torch.{d}" for d in _EXOTIC_DTYPES),
        *(f"torch.{t}Tensor" for t in _TENSOR_TYPES),
        *(f"torch.cuda.{s}" for s in STORAGE_DTYPES if not s.startswith("Q")),
        *(f"torch.cuda.{t}Tensor" for t in _TENSOR_TYPES),
        *(f"torch.{m}.{t}Tensor" for m in ("sparse", "cuda.sparse") for t in _TENSOR_TYPES if t != "Bool"),
    }
)

# What --allow-global may open: constructors of plain data (torch's add_safe_globals examples and the classes
# training code keeps in its config entries).
KNOWN_SAFE: frozenset[str] = frozenset(
    {
        "argparse.Namespace",
        "builtins.frozenset",
        "builtins.slice",
        "builtins.range",
        "collections.deque",
        "collections.defaultdict",
        "datetime.datetime",
        "datetime.date",
        "datetime.time",
        "datetime.timedelta",
        "datetime.timezone",
        "decimal.Decimal",
        "fractions.Fraction",
        "uuid.UUID",
        "pathlib.Path",
        "pathlib.PosixPath",
        "pathlib.WindowsPath",
        "pathlib.PurePath",
        "pathlib.PurePosixPath",
        "pathlib.PureWindowsPath",
        "numpy.dtype",
        "numpy.ndarray",
        "numpy.core.multiarray.scalar",
        "numpy._core.multiarray.scalar",
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct",
        *(
            f"numpy.dtypes.{t}DType"
            for t in (
                "Float64",
                "Float32",
                "Float16",
                "Int64",
                "Int32",
                "Int16",
                "Int8",
                "UInt64",
                "UInt32",
                "UInt16",
                "UInt8",
                "Bool",
                "Complex64",
                "Complex128",
                "Str",
                "Bytes",
            )
        ),
        *(
            f"numpy.{t}"
            for t in (
                "float64",
                "float32",
                "float16",
                "int64",
                "int32",
                "int16",
                "int8",
                "uint64",
                "uint32",
                "uint16",
                "uint8",
                "bool_",
                "complex64",
                "complex128",
            )
        ),
    }
)

# Globals torch accepts but whose values ckptfix cannot describe or use: refused as unsupported, not unsafe.
UNSUPPORTED: dict[str, str] = {
    "torch._utils._rebuild_meta_tensor_no_storage": "a meta tensor (a shape without data)",
    "torch._utils._rebuild_nested_tensor": "a nested tensor",
    "torch._utils._rebuild_wrapper_subclass": "a tensor subclass without storage (meta or wrapper)",
    "torch._utils._rebuild_device_tensor_from_numpy": "a tensor rebuilt from a numpy array",
}

# Modules whose members can run code, touch the system or import more code.
_NEVER_MODULES = (
    "os",
    "posix",
    "nt",
    "sys",
    "subprocess",
    "_posixsubprocess",
    "builtins",
    "__builtin__",
    "importlib",
    "runpy",
    "shutil",
    "socket",
    "pickle",
    "_pickle",
    "marshal",
    "code",
    "codeop",
    "ctypes",
    "pty",
    "multiprocessing",
    "webbrowser",
    "types",
    "functools",
    "operator",
    "io",
    "_io",
    "tempfile",
    "signal",
    "threading",
    "_thread",
    "asyncio",
    "pdb",
    "inspect",
    "dill",
    "cloudpickle",
    "joblib",
    "zipfile",
    "tarfile",
    "torch.hub",
    "torch.serialization",
    "torch.jit",
    "torch.package",
    "torch._dynamo",
    "torch._C",
    "torch.ops",
    "torch._ops",
    "torch.fx",
    "torch.storage",
    "torch.utils",
    "torch.distributed",
    "numpy.testing",
    "numpy.f2py",
    "numpy.distutils",
    "numpy.ctypeslib",
    "numpy.lib.format",
    "platform",
    "sysconfig",
    "zipimport",
    "site",
    "urllib",
    "http",
    "ssl",
    "smtplib",
    "ftplib",
    "telnetlib",
    "xmlrpc",
    "sqlite3",
    "shelve",
    "glob",
    "fileinput",
    "cProfile",
    "profile",
    "timeit",
    "trace",
    "doctest",
    "unittest",
    "venv",
    "ensurepip",
    "distutils",
    "setuptools",
    "pip",
)
_NEVER_NAMES = frozenset(
    {
        "eval",
        "exec",
        "compile",
        "getattr",
        "setattr",
        "delattr",
        "__import__",
        "open",
        "input",
        "globals",
        "locals",
        "vars",
        "breakpoint",
        "system",
        "popen",
        "spawn",
        "execv",
        "execve",
        "fork_exec",
        "load",
        "loads",
        "save",
        "call",
        "check_output",
        "run",
        "Popen",
        "import_module",
        "attrgetter",
        "methodcaller",
        "partial",
        "reduce",
        "_exec_with_source",
        "_load_from_bytes",
        "ZipFile",
    }
)


def canonical(name: str) -> str:
    """``module.Name`` as Python 3 resolves it (protocol-2 pickles say ``__builtin__.set``)."""
    module, _, attr = name.rpartition(".")
    if (module, attr) in _compat_pickle.NAME_MAPPING:
        module, attr = _compat_pickle.NAME_MAPPING[(module, attr)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{attr}"


def can_run_code(name: str) -> bool:
    """True for a global that can run code or reach the system (an allowlisted name never is)."""
    name = canonical(name)
    if name in TORCH_DEFAULT or name in KNOWN_SAFE:
        return False
    module, _, attr = name.rpartition(".")
    if any(module == m or module.startswith(m + ".") for m in _NEVER_MODULES):
        return True
    return any(part in _NEVER_NAMES or part.startswith("__") for part in attr.split("."))


def allowed_names(extra: Iterable[str], *, source: str) -> frozenset[str]:
    """The globals a file may name: torch's defaults plus the user's ``--allow-global`` names, each checked.

    A name outside :data:`KNOWN_SAFE` is imported and accepted only when it is an enum, a dataclass or a named
    tuple (see :func:`user_class`): the user named it, as with torch's ``add_safe_globals``.
    """
    names = set(TORCH_DEFAULT)
    for raw in extra:
        name = canonical(raw)
        if name in TORCH_DEFAULT:
            continue
        if can_run_code(name):
            raise UnsafeCheckpointError(
                f"{source}: allow_globals='{raw}': refused, it can run code or reach the system; no option "
                f"allows it (only unsafe=True, on a file you fully trust)"
            )
        if name not in KNOWN_SAFE:
            _check_user_class(raw, name, source=source)
        names.add(name)
    return frozenset(names)


def user_class(obj: Any) -> str | None:
    """What kind of data class ``obj`` is (``"an enum"``, ``"a dataclass"``, ``"a named tuple"``), or None.

    Rebuilding one calls nothing beyond its own class: an enum looks its member up by value, a dataclass or named
    tuple is made with ``cls.__new__`` and given its fields, as pickle and torch's weights-only loader do.
    """
    if not isinstance(obj, type):
        return None
    if issubclass(obj, enum.Enum):
        return "an enum"
    if dataclasses.is_dataclass(obj):
        return "a dataclass"
    if issubclass(obj, tuple) and isinstance(getattr(obj, "_fields", None), tuple):
        return "a named tuple"
    return None


def _check_user_class(raw: str, name: str, *, source: str) -> None:
    refusal = (
        f"{source}: allow_globals='{raw}': refused, not a known-safe class (ckptfix allows plain data constructors "
        f"such as argparse.Namespace and pathlib.PosixPath, and enums, dataclasses and named tuples of your own code)"
    )
    try:
        obj = _import(name)
    except (ImportError, AttributeError, ValueError) as e:
        raise UnsafeCheckpointError(f"{refusal}; it cannot be imported ({e})") from e
    if user_class(obj) is None:
        raise UnsafeCheckpointError(
            f"{refusal}; only unsafe=True opens this file, and only if you fully trust it (it runs the file's pickle)"
        )


def _import(name: str) -> Any:
    module_name, _, attr = name.rpartition(".")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _already_imported(name: str) -> Any:
    """The object behind ``name`` if its module is imported already (nothing is imported here), else None."""
    module_name, _, attr = name.rpartition(".")
    obj: Any = sys.modules.get(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    return obj


def refuse(names: Iterable[str], *, source: str) -> None:
    """Raise one error for every global a file needs outside its allowlist, with advice that is safe to follow."""
    needed = list(dict.fromkeys(canonical(n) for n in names))
    if not needed:
        return
    if sharded := explain(needed, source=source):
        raise sharded
    unsupported = [n for n in needed if n in UNSUPPORTED]
    if unsupported and len(unsupported) == len(needed):
        raise FormatError(
            f"{source}: holds {UNSUPPORTED[unsupported[0]]} ({unsupported[0]}), which ckptfix does not read; "
            f"save the tensors as plain CPU tensors"
        )
    dangerous = [n for n in needed if can_run_code(n)]
    if dangerous:
        raise UnsafeCheckpointError(
            f"{source}: refused: its pickle calls {', '.join(dangerous)}, which can run code; nothing was "
            f"executed. Do not load this file unless you wrote it",
            globals_needed=needed,
        )
    # A class of the user's own code may be named, but only one whose module is imported already is offered:
    # the advice must not lead anyone to import a module a file names.
    unknown = [n for n in needed if n not in KNOWN_SAFE and user_class(_already_imported(n)) is None]
    if unknown:
        raise UnsafeCheckpointError(
            f"{source}: refused: its pickle builds {', '.join(unknown)}, not a known-safe class; nothing was "
            f"executed. Only unsafe=True opens it, and only if you fully trust the file: it runs the file's "
            f"pickle, which can run any code",
            globals_needed=needed,
        )
    flags = " ".join(f"allow_globals='{g}'" for g in needed)
    raise UnsafeCheckpointError(
        f"{source}: needs globals outside the weights-only allowlist: {', '.join(needed)}; if you trust "
        f"where it came from, add {flags} (data classes: they build values and run nothing else); unsafe=True "
        f"opens it too but runs the file's pickle, which can run any code: only for a file you made yourself",
        globals_needed=needed,
    )


def resolve(names: Iterable[str], *, source: str) -> list[Callable[..., Any] | tuple[Callable[..., Any], str]]:
    """Import the objects behind allowed names for torch's ``safe_globals`` (names already checked)."""
    objects: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = []
    for name in names:
        try:
            obj = _import(canonical(name))
        except (ImportError, AttributeError, ValueError) as e:
            raise UnsafeCheckpointError(
                f"{source}: allow_globals='{name}': cannot import it ({e}); install the package that defines it"
            ) from e
        objects.append((obj, name))
    return objects


# Sharded tensors (formats/fsdp/ranks.py reads them): named here, so that a refusal can say what such a file is
# without this module importing the reader.
_DT = "torch.distributed.tensor."
DTENSOR_GLOBALS = frozenset(
    {
        "torch._tensor._rebuild_from_type_v2",
        "torch._utils._rebuild_wrapper_subclass",
        _DT + "DTensor",
        _DT + "_api.DTensor",
        _DT + "_dtensor_spec.DTensorSpec",
        _DT + "_dtensor_spec.TensorMeta",
        _DT + "_dtensor_spec.ShardOrderEntry",
        _DT + "placement_types.Shard",
        _DT + "placement_types.Replicate",
        _DT + "placement_types._StridedShard",
        _DT + "placement_types.Partial",
        "torch.distributed.device_mesh.DeviceMesh",
        "torch.distributed._mesh_layout._MeshLayout",
        "torch.distributed._mesh_layout._FlatLayout",
        "torch.device",
        "torch.serialization._get_layout",
    }
)
_SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor"
# FSDP1's ShardedTensor (SHARDED_STATE_DICT, LOCAL_STATE_DICT), read as records by formats/fsdp/ranks.py. Protocol 2
# names the nested ProcessGroupState class as getattr(ShardedTensor, "ProcessGroupState"): builtins.getattr is
# listed for that one lookup, which the inert reader resolves to a name of this set and never calls.
SHARDED_TENSOR_GLOBALS = frozenset(
    {
        "torch._tensor._rebuild_from_type_v2",
        "torch._utils._rebuild_wrapper_subclass",
        _SHARDED_TENSOR + ".api.ShardedTensor",
        _SHARDED_TENSOR + ".api.ShardedTensor.ProcessGroupState",
        _SHARDED_TENSOR + ".shard.Shard",
        _SHARDED_TENSOR + ".metadata.ShardedTensorMetadata",
        _SHARDED_TENSOR + ".metadata.TensorProperties",
        _SHARDED_TENSOR + ".metadata.MEM_FORMAT_ENCODING",
        "torch.distributed._shard.metadata.ShardMetadata",
        "torch.distributed._shard.sharding_spec.chunk_sharding_spec.ChunkShardingSpec",
        "torch.distributed.remote_device._remote_device",
        "builtins.getattr",
        "torch.device",
        "torch.serialization._get_layout",
    }
)


class ShardedCheckpointError(FormatError):
    """A file holds one rank's shards, not full tensors: merge every rank's file, or save a full state dict.

    ``kind``: ``dtensor`` (FSDP2 / tensor parallel: ``ckptfix merge`` reassembles them), ``sharded-tensor``
    (FSDP1 SHARDED_STATE_DICT: ``ckptfix merge`` reassembles them; or LOCAL_STATE_DICT) or ``flat-param`` (FSDP1
    flat parameters: only a LOCAL_STATE_DICT's are split, by ``ckptfix merge`` given the model that was wrapped).
    """

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def explain(names: Iterable[str], *, source: str) -> ShardedCheckpointError | None:
    """The error for a file refused only for naming sharded-tensor classes, saying what it is; else None."""
    names = set(names)
    if not names:
        return None
    if names <= DTENSOR_GLOBALS and any("DTensor" in n for n in names):
        return sharded_error("dtensor", source=source)
    if names <= SHARDED_TENSOR_GLOBALS and any(n.startswith(_SHARDED_TENSOR) for n in names):  # nothing else named
        return sharded_error("sharded-tensor", source=source)
    return None


def sharded_error(kind: str, *, source: str) -> ShardedCheckpointError:
    """The refusal of one rank's file of ``kind`` (``dtensor``, ``sharded-tensor``) read where full tensors are
    wanted, saying what it is and how to reassemble it."""
    if kind == "dtensor":
        return ShardedCheckpointError(
            f"{source}: holds DTensor shards (one rank's part of an FSDP2 or tensor-parallel model), not full "
            f"tensors; reassemble them from every rank's file with `ckptfix merge rank0.pt … rankN.pt -o "
            f"full.safetensors` (in Python: ckptfix.formats.fsdp.ranks.load_ranks) or save "
            f"get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))",
            kind="dtensor",
        )
    return ShardedCheckpointError(
        f"{source}: holds ShardedTensor shards (an FSDP1 LOCAL_STATE_DICT or SHARDED_STATE_DICT: one rank's "
        f"part), not full tensors; reassemble a SHARDED_STATE_DICT from every rank's file with `ckptfix merge "
        f"rank0.pt … rankN.pt -o full.pt`, or save a FULL_STATE_DICT "
        f"(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))",
        kind="sharded-tensor",
    )
