"""What a DeepSpeed run saved beside its model and optimizer, carried into the consolidated checkpoint.

``engine.save_checkpoint(dir, client_state=...)`` writes into the module file, beside the run's layout (which the
consolidation uses up: ``param_shapes``, ``buffer_names``, ``ds_config``, …), the engine's own progress
(``lr_scheduler``: the client scheduler's ``state_dict()``; ``global_steps``, ``global_samples``,
``skipped_steps``; ``data_sampler`` and ``random_ltd`` under curriculum learning) and every ``client_state`` key at
the top level (``deepspeed/runtime/engine.py``, ``_save_checkpoint``; ``load_checkpoint`` hands them back as the
client state). An fp16 run's optimizer files hold its ``DynamicLossScaler`` (``loss_scaler``), whose scale a resumed
mixed-precision run starts from. All of it is carried under its own key, as plain values and tensors; what is
neither (an object of the user's classes) is left out and named.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from ckptfix.formats.pickles import inert

# the module file's entries that describe the run's layout (consolidated into "model", not carried)
LAYOUT = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "ds_config",
        "ds_version",
        "universal_checkpoint_info",
    }
)
TAKEN = ("model", "optimizer")  # the consolidated checkpoint's own entries
_PLAIN = (type(None), bool, int, float, complex, str, bytes)
Tensor = Callable[[inert.InertTensor, str], Any]  # a contiguous tensor of the module file, and its key, as a record


class _NotPlainError(Exception):
    pass


def carried_state(
    module_file: Mapping[Any, Any], loss_scaler: Any, *, tensor: Tensor
) -> tuple[dict[str, Any], list[str]]:
    """The run's entries to carry (``tensor`` makes each tensor a record of the module file) and a note for each
    entry left out."""
    carried: dict[str, Any] = {}
    notes: list[str] = []
    for key, value in module_file.items():
        if key in LAYOUT or value is None:
            continue
        if not isinstance(key, str) or key in TAKEN:
            notes.append(
                f"client_state entry {key!r} not carried: the consolidated checkpoint's '{key}' is the "
                f"run's {key}; save it under another name"
            )
            continue
        try:
            carried[key] = _plain(value, key=key, tensor=tensor)
        except _NotPlainError as e:
            notes.append(
                f"client_state entry '{key}' not carried: it holds {e}, which ckptfix does "
                f"not build; save plain values and tensors in client_state"
            )
    scaler = _loss_scaler(loss_scaler)
    if scaler and "loss_scaler" not in carried:
        carried["loss_scaler"] = scaler
    return carried, notes


def _loss_scaler(obj: Any) -> dict[str, Any] | None:
    """A dynamic loss scaler's numbers (``cur_scale``, ``cur_iter``, ``last_overflow_iter``, ``scale_window``, …);
    None for the static scale of 1 that bf16 and fp32 runs save."""
    state = obj.state if isinstance(obj, inert.Inert) and not isinstance(obj, inert.InertTensor) else None
    if not isinstance(state, dict) or not (state.get("dynamic") is True or state.get("cur_scale", 1) != 1):
        return None
    return {str(k): v for k, v in state.items() if type(v) in (bool, int, float)}


def _plain(value: Any, *, key: str, tensor: Tensor) -> Any:
    if type(value) in _PLAIN:
        return value
    if isinstance(value, (inert.InertTensor, inert.InertParameter)):
        t = inert.tensor_of(value)
        if not t.is_contiguous():
            raise _NotPlainError("a strided view of a tensor")
        return tensor(t, key)
    if type(value) in (dict, OrderedDict):
        out: dict[Any, Any] = OrderedDict() if type(value) is OrderedDict else {}
        for k, v in value.items():
            if type(k) not in _PLAIN:
                raise _NotPlainError(f"a key of type {type(k).__name__}")
            out[k] = _plain(v, key=f"{key}.{k}", tensor=tensor)
        return out
    if type(value) in (list, tuple):
        return type(value)(_plain(v, key=f"{key}.{i}", tensor=tensor) for i, v in enumerate(value))
    what = value.func.full if isinstance(value, inert.Inert) else type(value).__name__
    raise _NotPlainError(f"a {what}")
