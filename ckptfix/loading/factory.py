"""Call a ``package.module:factory`` spec: the one rule every ``MOD:FACTORY`` option of ``ckptfix`` follows.

The factory's module may live in a folder that is not on ``sys.path``: a console script, unlike ``python -m``,
does not put the folder it runs in there, yet factories such as ``nano:build`` usually live right there. That
folder (``search_path``, the current one by default) is searched last and only while the factory is imported and
called, after torch is imported: a ``torch.py`` or ``numpy.py`` lying next to a checkpoint never shadows the
installed package.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ckptfix.errors import CkptfixError

if TYPE_CHECKING:
    import torch


HERE = os.curdir  # the folder the process runs in when the factory is imported (not when this module was)


class ModelSpecError(CkptfixError):
    """A ``spec`` or ``kwargs`` that cannot give what was asked; ``argument`` names which one.

    The message speaks of the library's arguments (``build_model(spec='m:f')``); a caller that took them from
    elsewhere (command-line flags) can say it in its own terms from ``function``, ``argument``, ``value`` and
    ``problem``.
    """

    def __init__(self, argument: str, value: object, problem: str, *, function: str = "build_model") -> None:
        self.argument, self.value, self.problem, self.function = argument, value, problem, function
        super().__init__(f"{function}({argument}={value!r}): {problem}")


def call_factory(
    spec: str,
    *args: Any,
    kwargs: str | Mapping[str, Any] | None = None,
    search_path: str | os.PathLike[str] | None = HERE,
    device: str | None = None,
    function: str = "call_factory",
) -> Any:
    """Import ``package.module:factory`` (a class or function; ``module:Outer.build`` too) and call it.

    ``args`` and ``kwargs`` (a mapping or a JSON object string) are its arguments. ``search_path`` is a folder
    searched after every other ``sys.path`` entry while the factory is imported and called: the current folder
    by default, None for none. ``device`` is the default device while it runs (``"meta"``: no weights made).
    ``function`` names the caller in messages.

    Raises:
        ModelSpecError: the spec or kwargs are malformed, or the factory cannot be imported or fails.

    >>> optimizer = call_factory("torch.optim:SGD", model.parameters(), kwargs={"lr": 0.1})
    """
    import torch  # first, so torch and what it imports come from the installed packages

    def error(argument: str, value: object, problem: str) -> ModelSpecError:
        return ModelSpecError(argument, value, problem, function=function)

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise error("spec", spec, "expected package.module:factory, e.g. torch.nn:Linear")
    kwargs = _parse_kwargs(kwargs, error)
    with _searched_last(search_path):
        try:
            factory: Any = importlib.import_module(module_name)
        except ImportError as e:
            fix = (
                "run from the folder that holds it or add that folder to PYTHONPATH"
                if search_path is not None
                else "add the folder that holds it to sys.path or PYTHONPATH"
            )
            raise error("spec", spec, f"cannot import '{module_name}' ({e}); {fix}") from e
        except (Exception, SystemExit) as e:  # the user's own module failed (or exited) while it ran
            raise error("spec", spec, f"importing '{module_name}' failed: {_failure(e)}") from e
        for part in attr.split("."):
            if not hasattr(factory, part):
                raise error("spec", spec, f"module '{module_name}' has no attribute '{attr}'")
            factory = getattr(factory, part)
        if not callable(factory):
            raise error("spec", spec, f"'{attr}' is not a class or function")
        try:
            with torch.device(device) if device is not None else contextlib.nullcontext():
                return factory(*args, **kwargs)
        except (Exception, SystemExit) as e:  # the user's own code: any failure means it cannot be built
            raise error("spec", spec, f"calling '{attr}' failed: {_failure(e)}") from e


def build_model(
    spec: str,
    *,
    kwargs: str | Mapping[str, Any] | None = None,
    search_path: str | os.PathLike[str] | None = HERE,
    device: str | None = None,
) -> torch.nn.Module:
    """Build a model from ``package.module:factory`` called with ``kwargs``, found as :func:`call_factory` finds it.

    ``device="meta"`` gives the model's structure without allocating or initialising its weights.

    Raises:
        ModelSpecError: as :func:`call_factory`, or the factory does not return a ``torch.nn.Module``.

    >>> model = build_model("torch.nn:Linear", kwargs='{"in_features": 2, "out_features": 3}')
    """
    import torch

    model = call_factory(spec, kwargs=kwargs, search_path=search_path, device=device, function="build_model")
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError("spec", spec, f"returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _failure(e: BaseException) -> str:
    # A factory that exits (builtins:exit, sys.exit(0)) is an error in the factory: exit status 0 from a command
    # that printed nothing would pass for success.
    if isinstance(e, SystemExit):
        return f"it exited (SystemExit: {e.code!r}) instead of returning"
    return f"{type(e).__name__}: {e}"


def _parse_kwargs(
    kwargs: str | Mapping[str, Any] | None, error: Callable[[str, object, str], ModelSpecError]
) -> dict[str, Any]:
    if not isinstance(kwargs, str):
        return dict(kwargs or {})
    try:
        parsed = json.loads(kwargs)
    except json.JSONDecodeError as e:
        raise error("kwargs", kwargs, f"not valid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(parsed, dict):
        raise error("kwargs", kwargs, "expected a JSON object such as '{\"in_features\": 2}'")
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
    spec: str, model: torch.nn.Module, *, search_path: str | os.PathLike[str] | None = HERE
) -> torch.optim.Optimizer:
    """The optimizer ``package.module:function`` builds for ``model`` (its one argument), as the training script
    builds it, found as :func:`call_factory` finds it: its param groups say which parameter each index of its
    ``state_dict()`` is.

    Raises:
        ModelSpecError: as :func:`call_factory`, or the function does not return a ``torch.optim.Optimizer``.

    >>> optimizer = build_optimizer("mytrain:configure_optimizers", build_model("mytrain:GPT"))  # doctest: +SKIP
    """
    import torch

    optimizer = call_factory(spec, model, search_path=search_path, function="build_optimizer")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ModelSpecError(
            "spec",
            spec,
            f"returned {type(optimizer).__name__}, not a torch.optim.Optimizer",
            function="build_optimizer",
        )
    return optimizer
