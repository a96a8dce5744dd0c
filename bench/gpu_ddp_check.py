"""save_for_ddp and load_for_ddp on NCCL, one process per GPU: run by bench/gpu_check.sh as

    torchrun --standalone --nproc-per-node N bench/gpu_ddp_check.py OUT_DIR

Every rank builds its model on its own GPU and loads, through load_for_ddp, files saved three ways (save_for_ddp
from a CUDA model, torch.save of a CUDA state dict, torch.save of a CPU one); a model that does not fit must
raise on every rank, not hang; a 0.5 GB model is timed. Prints one line per check; exits 1 on the first failure.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import ckptfix
from ckptfix.errors import CkptfixError


def build(seed: int, width: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, width, 3), nn.BatchNorm2d(width), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4)
    )  # fmt: skip


def ready(model: nn.Module, device: torch.device) -> nn.Module:
    model.to(device)
    model(torch.zeros(1, 3, 8, 8, device=device))  # materializes the lazy layer
    return model


def same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


def main(out: Path) -> int:
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    device = torch.device("cuda", local)
    say = (lambda text: print(f"[gpu_ddp_check] {text}", flush=True)) if rank == 0 else (lambda text: None)
    say(f"NCCL, {dist.get_world_size()} rank(s), {torch.cuda.get_device_name(device)}")
    reference = ready(build(0), device)
    files = {"save_for_ddp": out / "ddp_saved.pt", "cuda torch.save": out / "cuda.pt", "cpu torch.save": out / "cpu.pt"}
    ckptfix.save_for_ddp(nn.parallel.DistributedDataParallel(reference, device_ids=[local]), files["save_for_ddp"])
    if rank == 0:
        torch.save({"model": reference.state_dict()}, files["cuda torch.save"])
        torch.save({"model": {k: v.cpu() for k, v in reference.state_dict().items()}}, files["cpu torch.save"])
    dist.barrier()
    failed = 0
    for how, path in files.items():
        model = ready(build(1), device)
        ckptfix.load_for_ddp(model, path)
        ok = same(model, reference) and all(p.device == device for p in model.state_dict().values())
        say(f"{'PASS' if ok else 'FAIL'} load_for_ddp of a {how} file into a CUDA model")
        failed += not ok
    started = time.perf_counter()
    try:
        ckptfix.load_for_ddp(ready(build(1, width=8), device), files["save_for_ddp"], timeout=60)
        say("FAIL a model that does not fit loaded")
        failed += 1
    except CkptfixError as e:
        say(f"PASS a model that does not fit raised on every rank in {time.perf_counter() - started:.2f} s: {e}")
    big = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(8)]).to(device)
    ckptfix.save_for_ddp(big, out / "big.pt")
    target = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(8)]).to(device)
    torch.cuda.synchronize()
    dist.barrier()
    started = time.perf_counter()
    ckptfix.load_for_ddp(target, out / "big.pt")
    torch.cuda.synchronize()
    took = time.perf_counter() - started
    ok = same(target, big)
    size = os.path.getsize(out / "big.pt")
    say(f"{'PASS' if ok else 'FAIL'} load_for_ddp of {size / 1e9:.2f} GB into CUDA models: {took:.2f} s")
    failed += not ok
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
