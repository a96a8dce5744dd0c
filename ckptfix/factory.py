"""Build a model from a ``package.module:factory`` spec, as ``ckptfix validate --model`` and ``merge --model`` do.

The factory's module may live in a folder that is not on ``sys.path`` (the folder the command runs in). That
folder is searched last and only while the factory is imported and called, after torch is imported: a
``torch.py`` or ``numpy.py`` lying next to a checkpoint never shadows the installed package.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ckptfix.errors import CkptfixError

if TYPE_CHECKING:
    import torch


class ModelSpecError(CkptfixError):
    """``build_model``'s ``spec`` or ``kwargs`` cannot give a model; ``argument`` names which one.

    The message speaks of the library's arguments (``build_model(spec='m:f')``); a caller that took them from
    elsewhere (command-line flags) can say it in its own terms from ``argument``, ``value`` and ``problem``.
    """

    def __init__(self, argument: str, value: object, problem: str, *, function: str = "build_model") -> None:
        self.argument, self.value, self.problem = argument, value, problem
        super().__init__(f"{function}({argument}={value!r}): {problem}")


def build_model(
    spec: str,
    *,
    kwargs: str | Mapping[str, Any] | None = None,
    search_path: str | os.PathLike[str] | None = None,
    device: str | None = None,
) -> torch.nn.Module:
    """Build a model from ``package.module:factory`` (a class or function) called with ``kwargs``.

    ``kwargs`` is a mapping or a JSON object string. ``factory`` may be dotted (``module:Outer.build``).
    ``search_path`` is a folder searched after every other ``sys.path`` entry, while the factory is imported and
    called, for a module that is not installed. ``device`` is the default device while the factory runs:
    ``"meta"`` gives the model's structure without allocating or initialising its weights.

    Raises:
        ModelSpecError: the spec or kwargs are malformed, or the factory cannot be imported, called, or does not
            return a ``torch.nn.Module``.

    >>> model = build_model("torch.nn:Linear", kwargs='{"in_features": 2, "out_features": 3}')
    """
    import torch  # first, so torch and what it imports come from the installed packages

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ModelSpecError("spec", spec, "expected package.module:factory, e.g. torch.nn:Linear")
    kwargs = _parse_kwargs(kwargs)
    with _searched_last(search_path):
        try:
            factory: Any = importlib.import_module(module_name)
        except ImportError as e:
            fix = (
                "run from the folder that holds it or add that folder to PYTHONPATH"
                if search_path is not None
                else "add the folder that holds it to sys.path or PYTHONPATH"
            )
            raise ModelSpecError("spec", spec, f"cannot import '{module_name}' ({e}); {fix}") from e
        except (Exception, SystemExit) as e:  # the user's own module failed (or exited) while it ran
            raise ModelSpecError("spec", spec, f"importing '{module_name}' failed: {_failure(e)}") from e
        for part in attr.split("."):
            if not hasattr(factory, part):
                raise ModelSpecError("spec", spec, f"module '{module_name}' has no attribute '{attr}'")
            factory = getattr(factory, part)
        if not callable(factory):
            raise ModelSpecError("spec", spec, f"'{attr}' is not a class or function")
        try:
            with torch.device(device) if device is not None else contextlib.nullcontext():
                model = factory(**kwargs)
        except (Exception, SystemExit) as e:  # the user's own code: any failure means the model cannot be built
            raise ModelSpecError("spec", spec, f"building the model failed: {_failure(e)}") from e
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError("spec", spec, f"returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _failure(e: BaseException) -> str:
    # A factory that exits (builtins:exit, sys.exit(0)) is an error in the factory: exit status 0 from a command
    # that printed nothing would pass for success.
    if isinstance(e, SystemExit):
        return f"it exited (SystemExit: {e.code!r}) instead of returning a model"
    return f"{type(e).__name__}: {e}"


def _parse_kwargs(kwargs: str | Mapping[str, Any] | None) -> dict[str, Any]:
    if not isinstance(kwargs, str):
        return dict(kwargs or {})
    try:
        parsed = json.loads(kwargs)
    except json.JSONDecodeError as e:
        raise ModelSpecError("kwargs", kwargs, f"not valid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(parsed, dict):
        raise ModelSpecError("kwargs", kwargs, "expected a JSON object such as '{\"in_features\": 2}'")
    return parsed


@contextlib.contextmanager
def _searched_last(folder: str | os.PathLike[str] | None) -> Iterator[None]:
    """``folder`` at the end of ``sys.path`` for the duration, unless it is there already."""
    path = None if folder is None else os.path.abspath(folder)
    if path is None or any(os.path.abspath(p or os.curdir) == path for p in sys.path):
        yield
        return
    sys.path.append(path)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):  # the factory's own code may have removed it already
            sys.path.remove(path)


def build_optimizer(
    spec: str, model: torch.nn.Module, *, search_path: str | os.PathLike[str] | None = None
) -> torch.optim.Optimizer:
    """The optimizer ``package.module:function`` builds for ``model`` (its one argument), as the training script
    builds it: its param groups say which parameter each index of its ``state_dict()`` is. ``search_path`` as for
    :func:`build_model`.

    Raises:
        ModelSpecError: the spec is malformed, or the function cannot be imported, called, or does not return a
            ``torch.optim.Optimizer``.

    >>> optimizer = build_optimizer("mytrain:configure_optimizers", build_model("mytrain:GPT"))  # doctest: +SKIP
    """
    import torch

    def error(problem: str) -> ModelSpecError:
        return ModelSpecError("spec", spec, problem, function="build_optimizer")

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise error("expected package.module:function, e.g. train:configure_optimizers")
    with _searched_last(search_path):
        try:
            function: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                function = getattr(function, part)
        except (Exception, SystemExit) as e:  # not importable, no such attribute, or the module's own code failed
            raise error(f"cannot import '{attr}' from '{module_name}': {_failure(e)}") from e
        try:
            optimizer = function(model)
        except (Exception, SystemExit) as e:  # the user's own code
            raise error(f"building the optimizer for the model failed: {_failure(e)}") from e
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise error(f"returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
    return optimizer
