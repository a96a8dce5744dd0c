"""The parameters a conversion names optimizer state by, where the checkpoint does not say them: the model
``--model`` builds (on the meta device), or the optimizer ``--optimizer-factory`` builds for it."""

from __future__ import annotations

from ckptfix.errors import UsageError
from ckptfix.transforms.optim_form import Parameters


def model_parameters(spec: str) -> Parameters:
    """The parameters of the model ``spec`` builds (on the meta device: no weights made), as ``named_parameters()``
    gives them (tied ones once)."""
    from ckptfix.loading.factory import build_model

    named = list(build_model(spec, device="meta").named_parameters())
    return Parameters(tuple(n for n, _ in named), tuple(tuple(p.shape) for _, p in named), f"--model {spec}")


def parameters(model: str | None, optimizer_factory: str | None) -> Parameters | None:
    """What ``model`` and ``optimizer_factory`` (either may be None) say of the parameters; None where neither is
    given."""
    if optimizer_factory is not None:
        return optimizer_parameters(model, optimizer_factory)
    return None if model is None else model_parameters(model)


def optimizer_parameters(model: str | None, optimizer_factory: str) -> Parameters:
    """The parameters of the optimizer ``optimizer_factory`` builds for the model ``model`` builds (on the meta
    device), in the optimizer's order, group by group: each named as the model's ``named_parameters()`` name it."""
    from ckptfix.loading.factory import build_model, build_optimizer

    origin = f"--optimizer-factory {optimizer_factory}"
    if model is None:
        raise UsageError(
            f"optimizer_factory={optimizer_factory!r} builds the optimizer for a model: pass "
            f"model='MOD:FACTORY' too, the model the run trained"
        )
    built = build_model(model, device="meta")  # both found as every MOD:FACTORY is: the current folder searched last
    names = {id(p): n for n, p in built.named_parameters()}
    groups = [list(g["params"]) for g in build_optimizer(optimizer_factory, built).param_groups]
    params = [p for g in groups for p in g]
    if stray := [g for g, group in enumerate(groups) if any(id(p) not in names for p in group)]:
        raise UsageError(
            f"{origin}: param group {stray[0]} holds a tensor that is not a parameter of the model "
            f"--model {model} builds; build the optimizer from the model it is given"
        )
    return Parameters(
        tuple(names[id(p)] for p in params),
        tuple(tuple(p.shape) for p in params),
        origin,
        groups=tuple(len(g) for g in groups),
    )


__all__ = ["model_parameters", "optimizer_parameters", "parameters"]
