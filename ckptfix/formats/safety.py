"""Which pickle globals a checkpoint needs, and which of them a user may allow.

The real gate is torch's weights-only unpickler, which never calls anything outside its allowlist. This module
adds what it lacks: the full list of offending globals up front (torch stops at the first), and a hard line
under what ``--allow-global`` may open.
"""

from __future__ import annotations

import importlib
import io
import pickletools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO, Any, cast

from ckptfix.errors import UnsafeCheckpointError
from ckptfix.formats.st import DTYPES
from ckptfix.formats.st_header import ITEMSIZE as ST_ITEMSIZE

# Modules whose members can run code, touch the system or import more code: never allowable.
_NEVER_MODULES = (
    "os", "posix", "nt", "sys", "subprocess", "builtins", "__builtin__", "importlib", "runpy", "shutil", "socket",
    "pickle", "_pickle", "marshal", "code", "codeop", "ctypes", "pty", "multiprocessing", "webbrowser", "types",
    "functools", "operator", "io", "_io", "tempfile", "pathlib", "signal", "threading", "_thread", "asyncio", "pdb",
    "inspect", "dill", "cloudpickle", "joblib", "torch.hub", "torch.serialization", "torch.jit", "torch.package",
    "torch._dynamo", "torch._C", "torch.ops", "torch._ops", "numpy.testing", "numpy.f2py", "numpy.distutils",
    "numpy.ctypeslib", "numpy.lib.format", "platform", "sysconfig", "zipimport", "site", "urllib", "http", "ssl",
    "smtplib", "ftplib", "telnetlib", "xmlrpc", "sqlite3", "shelve", "glob", "fileinput", "cProfile", "profile",
    "timeit", "trace", "doctest", "unittest", "venv", "ensurepip", "distutils", "setuptools", "pip",
)  # fmt: skip
# Names that are dangerous wherever they are found.
_NEVER_NAMES = frozenset(
    {"eval", "exec", "compile", "getattr", "setattr", "delattr", "__import__", "open", "input", "globals", "locals",
     "vars", "breakpoint", "system", "popen", "spawn", "execv", "execve", "load", "loads", "call", "check_output",
     "run", "Popen", "import_module", "attrgetter", "methodcaller", "partial", "reduce"}
)  # fmt: skip


def never_allowable(name: str) -> bool:
    """True for a global that can run code or reach the system, which no option may allow."""
    module, _, attr = name.rpartition(".")
    if any(module == m or module.startswith(m + ".") for m in _NEVER_MODULES):
        return True
    return attr in _NEVER_NAMES or attr.startswith("__")


# Legacy storage class -> dtype; the element count in their persistent ids is in elements of that dtype.
STORAGE_DTYPES: dict[str, str] = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "LongStorage": "int64",
    "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "BFloat16Storage": "bfloat16", "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
}  # fmt: skip
# Bytes per element by torch dtype name: the safetensors dtypes, plus those safetensors cannot store.
ITEMSIZE: dict[str, int] = {name: ST_ITEMSIZE[code] for name, code in DTYPES.items()} | {
    "complex128": 16, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
}  # fmt: skip
_MARK = object()


@dataclass
class PickleScan:
    """What a pickle refers to, found without running it: its globals and the bytes each storage needs."""

    globals: list[str] = field(default_factory=list)
    storage_bytes: dict[str, int] = field(default_factory=dict)


def scan_pickle(data: bytes | IO[bytes] | io.RawIOBase, *, max_pickles: int = 1) -> PickleScan:
    """Every global (GLOBAL, INST, STACK_GLOBAL) and every torch storage persistent id of a pickle stream.

    A stack simulation driven by each opcode's documented stack effect follows memo references, so
    ``STACK_GLOBAL`` names and the ``('storage', StorageType, key, location, numel)`` tuples come out exact.
    Storage sizes matter because torch.load(mmap=True) does not compare a record's size with its storage: a
    short record yields tensors that read past it into the rest of the file. ``max_pickles`` reads that many
    consecutive pickles (the legacy torch format is five in a row).
    """
    stream = cast("IO[bytes]", io.BytesIO(data) if isinstance(data, bytes) else data)
    scan = PickleScan()
    for _ in range(max_pickles):
        stack: list[Any] = []
        memo: dict[int, Any] = {}
        for opcode, arg, _pos in pickletools.genops(stream):
            _simulate(opcode, arg, stack, memo, scan)
    scan.globals = list(dict.fromkeys(scan.globals))
    return scan


def _simulate(
    opcode: pickletools.OpcodeInfo, arg: Any, stack: list[Any], memo: dict[int, Any], scan: PickleScan
) -> None:
    name = opcode.name
    if name == "MARK":
        stack.append(_MARK)
    elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
        memo[int(str(arg))] = stack[-1] if stack else None
    elif name == "MEMOIZE":
        memo[len(memo)] = stack[-1] if stack else None
    elif name in ("BINGET", "LONG_BINGET", "GET"):
        stack.append(memo.get(int(str(arg))))
    else:
        if pickletools.markobject in opcode.stack_before:
            mark = len(stack) - 1 - stack[::-1].index(_MARK) if _MARK in stack else 0
            items = stack[mark + 1 :]
            del stack[mark:]
        else:
            count = len(opcode.stack_before)
            items = stack[len(stack) - count :] if count else []
            del stack[len(stack) - count :]
        value = _result(name, arg, items, scan)
        stack.extend([value] * len(opcode.stack_after))


def _result(name: str, arg: Any, items: list[Any], scan: PickleScan) -> Any:
    # The value an opcode leaves on the stack, as far as globals and storage ids need it.
    if name in ("GLOBAL", "INST", "STACK_GLOBAL"):
        module, qualname = str(arg).split(" ", 1) if arg is not None else (str(items[0]), str(items[-1]))
        scan.globals.append(f"{module}.{qualname}")
        return ("global", qualname)
    if name in ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"):
        return tuple(items)
    if name == "BINPERSID" and items:
        pid = items[-1]
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[2], str):
            storage, numel = pid[1], pid[4]
            kind = storage[1] if isinstance(storage, tuple) else None
            itemsize = 1 if kind == "UntypedStorage" else ITEMSIZE.get(STORAGE_DTYPES.get(str(kind), ""), 0)
            if isinstance(numel, int) and itemsize:
                scan.storage_bytes[pid[2]] = numel * itemsize
        return None
    return arg


def torch_allowed() -> set[str]:
    """Globals torch's weights-only unpickler accepts by default or through add_safe_globals."""
    from torch import _weights_only_unpickler as wo

    return set(wo._get_allowed_globals()) | set(wo._get_user_allowed_globals())  # type: ignore[no-untyped-call]


def resolve_allowed(names: Iterable[str], *, source: str) -> list[Any]:
    """Import the objects behind ``--allow-global module.Name`` after refusing the never-allowable ones."""
    objects = []
    for name in names:
        if never_allowable(name):
            raise UnsafeCheckpointError(
                f"{source}: --allow-global {name}: refused, it can run code or reach the system; "
                f"no option allows it (only --unsafe-pickle on a file you fully trust)"
            )
        module_name, _, attr = name.rpartition(".")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError, ValueError) as e:
            raise UnsafeCheckpointError(
                f"{source}: --allow-global {name}: cannot import it ({e}); install the package that defines it"
            ) from e
        objects.append((obj, name))
    return objects


def refuse_unknown(needed: list[str], *, allowed: Iterable[str], source: str) -> None:
    """Raise one error that lists every global outside the allowlist, naming the option that opens each."""
    allowed_set = set(allowed)
    missing = [g for g in needed if g not in allowed_set]
    if not missing:
        return
    dangerous = [g for g in missing if never_allowable(g)]
    if dangerous:
        raise UnsafeCheckpointError(
            f"{source}: refused: its pickle calls {', '.join(dangerous)}, which can run code; nothing was "
            f"executed. Do not load this file unless you wrote it",
            globals_needed=missing,
        )
    flags = " ".join(f"--allow-global {g}" for g in missing)
    raise UnsafeCheckpointError(
        f"{source}: needs globals outside the weights-only allowlist: {', '.join(missing)}; if you trust "
        f"where it came from, add {flags} (or, for a file you fully trust, --unsafe-pickle)",
        globals_needed=missing,
    )
