"""Run by `torchrun --nproc_per_node 2 tests/sharded_worker.py OUT_DIR` (gloo, CPU) from test_sharded.py.

accelerate drops FSDP on CPU (it runs DDP instead), so sharding is exercised through torch's own
APIs here: FSDP1 `FullyShardedDataParallel` and FSDP2 `fully_shard`. For every scenario each rank
also trains the same patched model on one process (the reference), then the wrapped model on its
half of each batch; the worker records losses, gates and logits of both, saves the wrapped model
with `ht.save_pretrained`, and checks what must be refused. test_sharded.py reads the JSON and
reloads the folders in a fresh process.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import VOCAB, make_tiny  # noqa: E402

import hf_tangent as ht  # noqa: E402
from hf_tangent.training.trainer import freeze_all_but_gates, gate_values  # noqa: E402

STEPS, BATCH, SEQ = 3, 4, 16
CONFIG = ht.TangentConfig(update="projected", gates=True)
SCENARIOS = [(engine, arch, mode) for engine in ("fsdp1", "fsdp2") for arch in ("llama", "gpt2")
             for mode in ("gates", "full")] + [("ddp", "llama", "gates"), ("fsdp2", "llama", "gates-bf16"),
                                               ("fsdp1", "llama", "gates-mixed-precision")]
# DeepSpeed ZeRO-3 (through its own API: accelerate runs no DeepSpeed on CPU), run on request only
ZERO3_SCENARIOS = [("zero3", "llama", "gates"), ("zero3", "llama", "full"), ("zero3", "gpt2", "full"),
                   ("zero3", "llama", "gates-bf16")]


def model_for(arch: str, mode: str):
    model = make_tiny(arch, **({"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if arch == "gpt2" else {}))
    if mode == "gates-bf16":
        model = model.to(torch.bfloat16)
    model = ht.patch(model, CONFIG)
    if mode.startswith("gates"):
        freeze_all_but_gates(model)
    return model.train()


def batches(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def layer_class(model):
    return type(ht.core.discovery.decoder_layers(model)[0])


def wrap(model, engine: str, mode: str):
    if engine == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if engine == "zero3":
        return deepspeed_engine(model)
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        precision = MixedPrecision(param_dtype=torch.bfloat16) if mode == "gates-mixed-precision" else None
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({layer_class(model)}),
                                        use_orig_params=True, device_id=torch.device("cpu"), mixed_precision=precision)
    from torch.distributed.fsdp import fully_shard

    for layer in ht.core.discovery.decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


ZERO3 = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
         "gradient_clipping": 0.0, "zero_force_ds_cpu_optimizer": False,
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # tiny params partitioned too


def deepspeed_engine(model):
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0),
                                      config=ZERO3)
    return engine


def train(model, shard: slice | None) -> list[float]:
    engine = model if type(model).__name__ == "DeepSpeedEngine" else None
    if engine is None:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    losses = []
    for ids in batches():
        ids = ids if shard is None else ids[shard]
        loss = model(input_ids=ids, labels=ids).loss
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        value = loss.detach().float()
        if shard is not None:
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(value.item())
    return losses


def eval_logits(model) -> torch.Tensor:
    ids = batches(seed=1)[0][:2]
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def refusals(wrapped, engine: str) -> dict[str, str]:
    """What patching after wrapping says, per way a user might try it."""
    targets = {"wrapper": wrapped}
    if engine in ("ddp", "fsdp1", "zero3"):
        targets["module"] = wrapped.module
    out = {}
    for name, target in targets.items():
        try:
            ht.patch(target, ht.TangentConfig(update="zero"))
            out[name] = "accepted"
        except ValueError as err:
            out[name] = str(err)
    return out


def run(engine: str, arch: str, mode: str, out_dir: Path, rank: int, world: int) -> dict:
    start = time.time()
    torch.manual_seed(0)
    reference = model_for(arch, mode)
    ref_losses = train(reference, None) if mode != "gates-mixed-precision" else None
    per_rank = BATCH // world
    model = model_for(arch, mode)
    wrapped = wrap(model, engine, mode)
    losses = train(wrapped, slice(rank * per_rank, (rank + 1) * per_rank))
    gates = gate_values(wrapped)  # collective under FSDP: every rank
    result = {"engine": engine, "arch": arch, "mode": mode, "losses": losses, "gates": gates,
              "get_config": ht.get_config(wrapped) == CONFIG.frozen_copy(),
              "tangent_layers": len(ht.tangent_layers(wrapped)), "refusals": refusals(wrapped, engine)}
    folder = out_dir / f"{engine}-{arch}-{mode}"
    saved = ht.save_pretrained(wrapped, folder)  # collective; rank 0 writes
    hub = ht.save_hub_folder(wrapped, out_dir / f"{engine}-{arch}-{mode}-hub")
    if ref_losses is not None:
        result |= {"reference_losses": ref_losses, "reference_gates": gate_values(reference)}
    if rank == 0 and saved is not None:
        torch.save(eval_logits(reference.eval()), folder / "reference_logits.pt")
        result |= {"saved": str(saved), "hub": str(hub)}
    if mode == "gates":  # unpatch through the wrapper: the unpatched forward again
        ht.unpatch(wrapped)
        plain = make_tiny(arch, **({"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if arch == "gpt2" else {}))
        wrapped.eval()  # (a DeepSpeed engine's eval() returns None)
        result["unpatch_max_diff"] = (eval_logits(wrapped) - eval_logits(plain.eval())).abs().max().item()
        result["unpatched_config"] = ht.get_config(wrapped) is None
    result["seconds"] = round(time.time() - start, 2)
    return result


def main() -> None:
    out_dir = Path(sys.argv[1])
    only = sys.argv[2:] or None
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for engine, arch, mode in SCENARIOS + ZERO3_SCENARIOS:
        if (only is None and engine == "zero3") or (only and f"{engine}-{arch}-{mode}" not in only):
            continue
        try:
            results.append(run(engine, arch, mode, out_dir, rank, world))
        except Exception as err:  # recorded per scenario; the test names it
            import traceback

            results.append({"engine": engine, "arch": arch, "mode": mode, "error": f"{type(err).__name__}: {err}",
                            "traceback": traceback.format_exc()[-1500:]})
        dist.barrier()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
