"""A nanoGPT-style model and its optimizer, built as karpathy/nanoGPT's ``model.py`` builds them: token and position
embeddings, pre-norm blocks, the output head tied to the token embedding, and ``configure_optimizers``' two AdamW
groups (every parameter of two or more dimensions decayed, the rest not), which interleave the model's order.

``build`` and ``configure_optimizers`` are what ``ckptfix convert --model tests.nanogpt:build --optimizer-factory
tests.nanogpt:configure_optimizers`` calls; ``train`` is the run that saves ``{"model", "optimizer", "iter_num"}``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

VOCAB, BLOCK, EMBD, LAYERS = 16, 8, 8, 2
LR, SAVED_LR = 6e-4, 3e-4  # the optimizer's rate as built, and the rate the run's schedule had reached at the save


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(EMBD)
        self.attn = nn.MultiheadAttention(EMBD, 2, batch_first=True)
        self.ln_2 = nn.LayerNorm(EMBD)
        self.mlp = nn.Sequential(nn.Linear(EMBD, 4 * EMBD), nn.GELU(), nn.Linear(4 * EMBD, EMBD))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))  # type: ignore[no-any-return]


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, EMBD)
        self.wpe = nn.Embedding(BLOCK, EMBD)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(EMBD)
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # type: ignore[no-any-return]


def build(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT()


def configure_optimizers(model: nn.Module) -> torch.optim.AdamW:
    """nanoGPT's ``GPT.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, betas=(0.9, 0.95), "cpu")``."""
    param_dict = {pn: p for pn, p in model.named_parameters()}
    param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
    decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
    nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
    optim_groups = [{"params": decay_params, "weight_decay": 0.1}, {"params": nodecay_params, "weight_decay": 0.0}]
    return torch.optim.AdamW(optim_groups, lr=LR, betas=(0.9, 0.95))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    data = torch.randint(0, VOCAB, (4, BLOCK + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def train(path: Path, *, steps: int = 2) -> tuple[GPT, torch.optim.AdamW]:
    """A run of ``steps`` steps saved to ``path`` as nanoGPT's ``train.py`` saves it; the model and optimizer."""
    model = build()
    opt = configure_optimizers(model)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
    for group in opt.param_groups:  # train.py sets each group's rate from its schedule every iteration
        group["lr"] = SAVED_LR
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": steps}, path)
    return model, opt


def resume_fsdp2(rank: int, world: int, store: str, folder: str, out: str) -> None:
    """One rank of the FSDP2 job of docs/resume.md: the model sharded, the optimizer built by the run's own
    function, then ``dcp.load`` into what ``get_state_dict`` gives and ``set_state_dict``; rank 0 writes to ``out``
    the full optimizer state by parameter name and each group's hyperparameters."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        model = build(seed=99)  # every value must come from the checkpoint
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        optimizer = configure_optimizers(model)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                   cpu_offload=True))  # fmt: skip
        groups = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in optimizer.param_groups]
        if rank == 0:
            torch.save({"state": full["state"], "groups": groups}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(f"{out}.done{rank}").touch()
