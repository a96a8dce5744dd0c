"""Real Megatron-Core ``torch_dist`` checkpoints for the tests: a small ``GPTModel`` (RMSNorm, SwiGLU, grouped-query
attention, rotary embeddings; a mixture-of-experts variant) trained a few steps on gloo ranks on the CPU with
tensor, pipeline or expert parallelism (none on one rank; TP 2 x PP 2 on four), then saved with
``dist_checkpointing.save`` (the ``torch_dist`` backend).
Beside each run folder, ``NAME.expected.safetensors`` is Megatron's own load of it into a TP=1, PP=1 model
(``model.state_dict()``, ``_extra_state`` entries left out), with the layer spec's own
``sharded_state_dict_keys_map`` in its metadata: what a conversion must give, once the names are mapped; and
``NAME.logits.safetensors``, that model's forward on a fixed input in float32 (``logits``) and, for a bf16 run, in
bf16 (``logits_bf16``): what an HF export must give.

It needs megatron-core, which ckptfix's own environment does not hold (megatron-core 0.16.1 is the last release
for Python 3.11)::

    python3 -m venv mcore-venv && mcore-venv/bin/pip install torch==2.13.0 megatron-core==0.16.1 psutil safetensors
    mcore-venv/bin/python -m tests.megatron_runs fixtures/megatron --fixtures

Megatron-Core asks CUDA three things on the way, even on gloo: ``torch.cuda.synchronize()`` (nothing to wait for
on the CPU), ``torch.cuda.current_device()`` (the device of a small flag tensor) and the CUDA RNG state forked
around attention dropout (0 here); :func:`_cpu_stand_ins` answers them for the CPU. The MoE router of 0.16.1
reads ``te_general_gemm``, defined only when Transformer Engine imports: it is set to None, what it means
without Transformer Engine. Nothing else is touched: the model, its sharded state dict and the writer are
Megatron's own.
Pipeline stages hand activations and gradients over with ``torch.distributed.send``/``recv``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# name: tensor, pipeline and expert parallel sizes, dtype, mixture of experts, tied embeddings, layers (if not
# LAYERS: the folders are kept small), Adam (else SGD): its state saved beside the model, as Megatron-LM saves it.
# Each runs on tp * pp * ep gloo ranks (:func:`world`): the plain layout on one, TP 2 x PP 2 on four.
RUNS: dict[str, dict[str, Any]] = {
    "tp1_pp1_fp32": {"tp": 1, "pp": 1, "ep": 1, "dtype": "fp32", "moe": False, "tied": False, "layers": 2},
    "tp2_pp2_bf16": {"tp": 2, "pp": 2, "ep": 1, "dtype": "bf16", "moe": False, "tied": False, "layers": 2},
    "tp2_fp32": {"tp": 2, "pp": 1, "ep": 1, "dtype": "fp32", "moe": False, "tied": True, "layers": 2},
    "pp2_vpp2_bf16": {"tp": 1, "pp": 2, "ep": 1, "dtype": "bf16", "moe": False, "tied": False, "vpp": 2},
    "tp2_bf16": {"tp": 2, "pp": 1, "ep": 1, "dtype": "bf16", "moe": False, "tied": False, "layers": 2, "adam": True},
    "moe_ep2_fp32": {"tp": 1, "pp": 1, "ep": 2, "dtype": "fp32", "moe": True, "tied": False, "layers": 2},
}
STEPS = 3
# the benchmark's run (bench/bench_megatron.py), made larger with --size; not a fixture
BENCH = {"bench_tp2_bf16": {"tp": 2, "pp": 1, "ep": 1, "dtype": "bf16", "moe": False, "tied": False}}
# saved under a wrapping module's prefix (GPTModel.sharded_state_dict("module.")); made by a slow test, not a fixture
WRAPPED = {"module_tp2_fp32": {"tp": 2, "pp": 1, "ep": 1, "dtype": "fp32", "moe": False, "tied": False, "layers": 2,
                               "prefix": "module."}}  # fmt: skip
_SIZE = ""  # --size as given, passed on to the ranks
TIMEOUT = 600  # seconds a run's ranks may take together (a fixture run takes under a minute on 2 cores)
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, SEQ, EXPERTS = 4, 16, 4, 2, 32, 32, 8, 2


FIXTURES = ROOT / "fixtures" / "megatron"


def fixture_runs() -> dict[str, dict[str, Any]]:
    """What ``fixtures/megatron/MANIFEST.json`` records of each run made (its layout, dtype, layers, world size)."""
    runs: dict[str, dict[str, Any]] = json.loads((FIXTURES / "MANIFEST.json").read_text())["runs"]
    return runs


def prefixed(src: Path, dst: Path, prefix: str) -> Path:
    """Run folder ``src`` copied to ``dst`` with every key under ``prefix`` (``module.``), as a wrapped model's
    ``sharded_state_dict(prefix=...)`` names them: DCP's plan (``.metadata``) read and written again by torch's own
    classes, each key renamed; the data files, which hold no names, as Megatron wrote them."""
    import dataclasses
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    shutil.copytree(src, dst)
    plan = FileSystemReader(str(src)).read_metadata()
    plan.state_dict_metadata = {prefix + k: v for k, v in plan.state_dict_metadata.items()}
    plan.storage_data = {dataclasses.replace(i, fqn=prefix + i.fqn): v for i, v in plan.storage_data.items()}
    with open(dst / ".metadata", "wb") as f:
        pickle.dump(plan, f)  # as torch's FileSystemWriter writes it
    return dst


def world(run: dict[str, Any]) -> int:
    """The ranks a run is trained and saved on: one per tensor, pipeline and expert rank (no data parallelism but
    the MoE run's, whose expert ranks are carved out of the data-parallel ones)."""
    return int(run["tp"] * run["pp"] * run["ep"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_stand_ins() -> None:
    import torch

    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    from megatron.core import tensor_parallel

    # attention dropout (0 here) runs inside a fork of the CUDA RNG tracker's state: nothing to fork on the CPU
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1 names it whether or not Transformer Engine imported
        moe_utils.te_general_gemm = None


def _config(run: dict[str, Any], *, tp: int, pp: int, ep: int, vpp: int | None = None) -> Any:
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch.nn.functional import silu

    dtype = torch.bfloat16 if run["dtype"] == "bf16" else torch.float32
    moe = {"num_moe_experts": EXPERTS, "moe_router_topk": 2, "moe_token_dispatcher_type": "allgather",
           "moe_aux_loss_coeff": 0.0} if run["moe"] else {}  # fmt: skip
    return TransformerConfig(
        num_layers=run.get("layers", LAYERS), hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        ffn_hidden_size=FFN, normalization="RMSNorm", gated_linear_unit=True, activation_func=silu,
        add_bias_linear=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype, hidden_dropout=0.0, attention_dropout=0.0, virtual_pipeline_model_parallel_size=vpp,
        **moe,
    )  # fmt: skip


def _model(run: dict[str, Any], *, tp: int, pp: int, ep: int, vpp: int | None = None) -> list[Any]:
    """This rank's model chunks: one, or one per virtual pipeline stage (``vpp``)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = _config(run, tp=tp, pp=pp, ep=ep, vpp=vpp)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS if run["moe"] else None, normalization="RMSNorm")
    chunks = []
    for stage in range(vpp) if vpp else [None]:
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=stage is None, vp_stage=stage)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=stage is None, vp_stage=stage)
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
            pre_process=first, post_process=last, share_embeddings_and_output_weights=run["tied"],
            position_embedding_type="rope", vp_stage=stage,
        ).to(config.params_dtype))  # fmt: skip
    return chunks


def _args(run: dict[str, Any]) -> argparse.Namespace:
    """The model arguments Megatron-LM's training loop keeps in ``common.pt`` (``args``), by its names."""
    import torch

    return argparse.Namespace(
        num_layers=run.get("layers", LAYERS), hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        group_query_attention=True, num_query_groups=GROUPS, padded_vocab_size=VOCAB, max_position_embeddings=SEQ,
        normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
        untie_embeddings_and_output_weights=not run["tied"], tensor_model_parallel_size=run["tp"],
        pipeline_model_parallel_size=run["pp"], expert_model_parallel_size=run["ep"],
        virtual_pipeline_model_parallel_size=run.get("vpp"),
        num_experts=EXPERTS if run["moe"] else None, bf16=run["dtype"] == "bf16",
        params_dtype=torch.bfloat16 if run["dtype"] == "bf16" else torch.float32,
        # what Megatron-LM's parser also records, at the values the model above runs with (TransformerConfig's and
        # GPTModel's defaults); the tokenizer's size (vocab_size) below the padded one, as --vocab-size says it
        kv_channels=HIDDEN // HEADS, norm_epsilon=1e-5, rotary_base=10000, rotary_percent=1.0,
        rotary_interleaved=False, add_bias_linear=False, add_qkv_bias=False, qk_layernorm=False,
        vocab_size=VOCAB - 2, make_vocab_size_divisible_by=VOCAB // run["tp"], seq_length=SEQ,
        moe_router_topk=2 if run["moe"] else None, moe_router_pre_softmax=False,
        moe_router_score_function="softmax",
    )  # fmt: skip


def _train(chunks: list[Any], run: dict[str, Any], *, pp: int) -> Any:
    """A few SGD (or Adam) steps on one fixed batch (the same on every rank, so data-parallel replicas stay equal);
    the Adam optimizer, or None. The pipeline's stages (``pp`` ranks × this rank's chunks, virtual stage ``v`` of
    rank ``r`` being stage ``v * pp + r``) run forward in order, each handing its activations to the next rank's,
    then backward in reverse, each handing its input's gradient back."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    params = [p for m in chunks for p in m.parameters() if p.requires_grad]
    adam = torch.optim.Adam(params, lr=1e-2) if run.get("adam") else None
    rank = parallel_state.get_pipeline_model_parallel_rank()
    # pipeline rank -> global rank, for send/recv: with TP 2 x PP 2, tensor rank t of stage s talks to tensor rank t
    # of stages s - 1 and s + 1
    ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    dtype = torch.bfloat16 if run["dtype"] == "bf16" else torch.float32
    stages = len(chunks) * pp
    for _ in range(STEPS):
        for p in params:
            p.grad = None
        kept: dict[int, tuple[Any, Any]] = {}  # stage -> (its input, its output)
        for stage in range(rank, stages, pp):
            model = chunks[stage // pp]
            x = None
            if stage > 0:
                x = torch.empty(SEQ, 2, HIDDEN, dtype=dtype)
                dist.recv(x, ranks[(stage - 1) % pp])
                x.requires_grad_(True)
                model.set_input_tensor(x)
            last = stage == stages - 1
            out = model(tokens if stage == 0 else None, position_ids, mask, labels=labels if last else None)
            if not last:
                dist.send(out.detach().contiguous(), ranks[(stage + 1) % pp])
            kept[stage] = (x, out)
        for stage in sorted(kept, reverse=True):
            x, out = kept[stage]
            if stage == stages - 1:
                out.float().mean().backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, ranks[(stage + 1) % pp])
                out.backward(grad)
            if x is not None:
                dist.send(x.grad.contiguous(), ranks[(stage - 1) % pp])
        if adam is not None:
            adam.step()
            continue
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.add_(p.grad.to(p.dtype), alpha=-0.5)
    return adam


def _optimizer_and_rng(model_sd: Any, adam: Any) -> dict[str, Any]:
    """The optimizer state as Megatron-Core's ``FP32Optimizer.sharded_state_dict`` makes it (each moment a sharded
    tensor like its parameter, the step shared), and the RNG state as Megatron-LM's training loop saves it (one
    ``ShardedObject`` per pipeline and tensor rank)."""
    import random

    import torch
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    optim = adam.state_dict()
    id_map = get_param_id_to_sharded_param_map(model_sd, [p for g in adam.param_groups for p in g["params"]])
    steps = [s.pop("step") for s in optim["state"].values()]
    optim_state_to_sharding_state(optim, id_map, exclude_keys="step")
    optim["state"]["common_step"] = steps[0]
    ps = parallel_state
    pp, tp = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    rng = [{"random_rng_state": random.getstate(), "torch_rng_state": torch.get_rng_state()}]
    sizes = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size())
    replica = parallel_state.get_data_parallel_rank()
    return {"optimizer": optim, "rng_state": ShardedObject("rng_state", rng, sizes, (pp, tp), replica_id=replica)}


def _worker(out: Path, name: str) -> None:
    import torch
    import torch.distributed as dist

    _cpu_stand_ins()
    from megatron.core import dist_checkpointing, parallel_state

    run = {**RUNS, **BENCH, **WRAPPED}[name]
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(run["tp"], run["pp"], virtual_pipeline_model_parallel_size=run.get("vpp"),
                                             expert_model_parallel_size=run["ep"])  # fmt: skip
    torch.manual_seed(1234)
    chunks = _model(run, tp=run["tp"], pp=run["pp"], ep=run["ep"], vpp=run.get("vpp"))
    adam = _train(chunks, run, pp=run["pp"])
    # as Megatron-LM saves them: "model", or "model0", "model1" … with virtual pipeline stages
    parts = {"model": chunks[0].sharded_state_dict(run.get("prefix", ""))} if len(chunks) == 1 else {
        f"model{i}": m.sharded_state_dict() for i, m in enumerate(chunks)}  # fmt: skip
    model_sd = parts.get("model")
    state = {**parts, "args": _args(run), "iteration": STEPS, "checkpoint_version": 3.0}
    if adam is not None:
        state.update(_optimizer_and_rng(model_sd, adam))
    folder = out / name
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, str(folder), sharded_strategy=("torch_dist", 1))
    dist.barrier()
    dist.destroy_process_group()


def _expected(out: Path, name: str) -> None:
    """Megatron's own load of the run into a TP=1, PP=1 model, on one rank: the state dict a conversion must give."""
    import torch
    import torch.distributed as dist

    _cpu_stand_ins()
    from megatron.core import dist_checkpointing, parallel_state

    run = {**RUNS, **BENCH, **WRAPPED}[name]
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(99)  # other initial values than the run's: every tensor must come from the load
    (model,) = _model(run, tp=1, pp=1, ep=1)
    prefix = run.get("prefix", "")
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(prefix)}, str(out / name))
    model.load_state_dict({k.removeprefix(prefix): v for k, v in loaded["model"].items()})
    from safetensors.torch import save_file

    state = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    # the layer spec's own map from its state-dict names to the names it saves under (the local spec keeps its
    # norms apart; the checkpoint names them as Transformer Engine's fused layers do)
    keys_map = dict(model.decoder.layers[0].submodules_config.sharded_state_dict_keys_map)
    save_file(
        state, out / f"{name}.expected.safetensors", metadata={"sharded_state_dict_keys_map": json.dumps(keys_map)}
    )
    # GPTModel's own forward on a fixed input, in float32 (a bf16 run's weights cast up): what an HF export's
    # logits must equal; a bf16 run's forward in bf16 too (``logits_bf16``): what its export loaded in bf16 gives
    ids = (torch.arange(SEQ) * 7 % (VOCAB - 2)).reshape(1, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    saved: dict[str, Any] = {"input_ids": ids}
    if run["dtype"] != "fp32":
        with torch.no_grad():
            saved["logits_bf16"] = model.eval()(ids, torch.arange(SEQ).unsqueeze(0), mask).contiguous()
        # the same weights in a float32 model: Megatron's attention computes in its config's dtype
        (model_fp32,) = _model(dict(run, dtype="fp32"), tp=1, pp=1, ep=1)
        model_fp32.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        model = model_fp32
    with torch.no_grad():
        logits = model.eval()(ids, torch.arange(SEQ).unsqueeze(0), mask)
    save_file({**saved, "logits": logits.contiguous()}, out / f"{name}.logits.safetensors")
    dist.destroy_process_group()


def _spawn(out: Path, name: str, *, role: str, world: int) -> None:
    port = _free_port()
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1", PYTHONPATH=path)  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.megatron_runs", str(out), "--run", name, "--role", role, "--size", _SIZE],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    try:  # a rank that hangs (a send with no recv) is killed, its peers with it: no process left behind
        outputs = [p.communicate(timeout=TIMEOUT)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, text in zip(procs, outputs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"megatron {role} of {name} failed:\n{text[-4000:]}")


def make_run(out: Path, name: str) -> Path:
    """Train and save run ``name`` into ``out/name`` and its TP=1, PP=1 load into ``out/name.expected.safetensors``."""
    _spawn(out, name, role="train", world=world({**RUNS, **BENCH, **WRAPPED}[name]))
    _spawn(out, name, role="expected", world=1)
    return out / name


def _resize(spec: str) -> None:
    """``--size hidden=2048,layers=10``: the model's sizes (and ``steps``) other than the fixtures', for the
    benchmark; a run's own ``layers`` still wins."""
    global _SIZE
    _SIZE = spec
    names = {"layers", "hidden", "heads", "groups", "ffn", "vocab", "seq", "experts", "steps"}
    for part in filter(None, spec.split(",")):
        name, _, value = part.partition("=")
        if name not in names or not value.isdigit():
            raise SystemExit(f"--size {spec}: {part!r} is not one of {sorted(names)}=N")
        globals()[name.upper()] = int(value)


def _manifest(out: Path) -> None:
    import megatron.core
    import torch

    manifest = {
        "command": "mcore-venv/bin/python -m tests.megatron_runs fixtures/megatron --fixtures",
        "platform": {"torch": torch.__version__, "megatron-core": megatron.core.__version__,
                     "python": sys.version.split()[0]},
        "runs": {name: dict(RUNS[name], layers=RUNS[name].get("layers", LAYERS), steps=STEPS,
                            world_size=world(RUNS[name])) for name in RUNS},
    }  # fmt: skip
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--run", choices=sorted({**RUNS, **BENCH, **WRAPPED}))
    parser.add_argument("--role", choices=("train", "expected"))
    parser.add_argument("--fixtures", action="store_true", help="every run, and MANIFEST.json")
    parser.add_argument("--size", default="", help="e.g. hidden=2048,layers=10,ffn=5632,vocab=32000,steps=1")
    a = parser.parse_args()
    _resize(a.size)
    if a.role == "train":
        _worker(a.out, a.run)
    elif a.role == "expected":
        _expected(a.out, a.run)
    elif a.fixtures:
        a.out.mkdir(parents=True, exist_ok=True)
        for name in [a.run] if a.run else RUNS:  # --run NAME: that run again, the manifest rewritten
            shutil.rmtree(a.out / name, ignore_errors=True)
            make_run(a.out, name)
        _manifest(a.out)
    else:
        make_run(a.out, a.run)


if __name__ == "__main__":
    main()
