"""Options shared by the ``ckptfix`` commands, and what turns them into library calls."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import click

from ckptfix.cli.render import Output
from ckptfix.errors import CkptfixError, UsageError

if TYPE_CHECKING:
    import torch


def safety_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--allow-global`` and ``--unsafe-pickle``, for every command that reads a .pt file."""
    f = click.option(
        "--unsafe-pickle",
        is_flag=True,
        help="UNSAFE: run the full pickle machinery. Only for a file you made yourself; it can run code.",
    )(f)
    return click.option(
        "--allow-global",
        "allow_globals",
        multiple=True,
        metavar="module.Name",
        help="Let the weights-only loader build this class (repeatable), e.g. argparse.Namespace.",
    )(f)


def to_option(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--to LAYOUT``, any case (``DDP``), single by default."""
    from ckptfix.transforms.layouts import TARGETS

    return click.option(
        "--to", type=click.Choice(TARGETS, case_sensitive=False), default="single", show_default=True, help=what
    )


def json_option(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--json``, given to the command as its :class:`~ckptfix.cli.render.Output` (``output``): whether the result
    prints as JSON is decided here, once."""
    return click.option(
        "--json", "output", is_flag=True, help=what, callback=lambda ctx, param, value: Output(bool(value))
    )


def tolerance_option(name: str, what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--atol`` or ``--rtol``: a finite number, zero or more, 0 by default. ``nan`` makes every comparison fail
    (or pass) unseen, ``inf`` (or ``1e400``, which reads as it) is no tolerance, and neither is a JSON number
    (``--json`` is strict JSON): refused here, naming the option, exit 2."""

    def tolerance(ctx: click.Context, param: click.Parameter, value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and number >= 0.0):
            raise UsageError(
                f"{name} {value}: a tolerance is a finite number, zero or more; give one such as {name} 1e-6"
            )
        return number

    return click.option(name, metavar="FLOAT", default="0.0", show_default=True, help=what, callback=tolerance)


force_option = click.option(
    "--force",
    "overwrite",
    is_flag=True,
    help="Replace OUT if it exists; the old output stays whole until the new one is. Default: refuse.",
)

architecture_option = click.option(
    "--architecture",
    metavar="NAME",
    help="--format hf: the transformers model class (LlamaForCausalLM), written into config.json. Default: the "
    "config's architectures, else the one class of its model_type whose keys the checkpoint fills.",
)


def model_from_options(model_spec: str, kwargs: str | None, *, device: str | None = None) -> torch.nn.Module:
    """The model of ``--model`` and ``--kwargs`` (on ``device``), found as every ``MOD:FACTORY`` is
    (:func:`ckptfix.loading.factory.call_factory`); errors name the flags."""
    from ckptfix.loading.factory import build_model

    with model_flags():
        return build_model(model_spec, kwargs=kwargs, device=device)


@contextlib.contextmanager
def model_flags() -> Iterator[None]:
    """A :class:`~ckptfix.loading.factory.ModelSpecError` raised inside (a ``with`` block, or a command it decorates),
    said
    in the CLI's terms: ``--model 'm:f'`` or ``--kwargs`` instead of the library's ``build_model(spec='m:f')``."""
    from ckptfix.loading.factory import ModelSpecError

    try:
        yield
    except ModelSpecError as e:
        if e.function != "build_model":  # another factory's (an optimizer's): its own flag says it
            raise
        flag = "--kwargs" if e.argument == "kwargs" else f"--model '{e.value}'"
        raise CkptfixError(f"{flag}: {e.problem}") from e
