"""What a model may be wrapped in (PEFT, DDP, FSDP1, FSDP2, DeepSpeed) and how to read through it.

The patch lives on the transformers model inside every wrapper. Reading or saving it through a
sharding engine needs the engine's own gathering API: FSDP1 `summon_full_params`, FSDP2
`DTensor.full_tensor`, ZeRO-3 `GatheredParameters`. Those are collectives: every rank calls them.
"""

from __future__ import annotations

import gc
import importlib
from contextlib import ExitStack, contextmanager

import torch
from torch import nn


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _is_deepspeed_engine(model) -> bool:
    return type(model).__name__ == "DeepSpeedEngine" and isinstance(getattr(model, "module", None), nn.Module)


def _fsdp1_class():
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch built without distributed
        return None
    return FullyShardedDataParallel


def _fsdp2_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def peft_model_of(model):
    """The PEFT model inside DDP / FSDP1 / DeepSpeed wrappers (or `model` itself), None without PEFT."""
    fsdp1 = _fsdp1_class()
    for _ in range(8):
        if _is_peft(model):
            return model
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)) or _is_deepspeed_engine(model) \
                or (fsdp1 is not None and isinstance(model, fsdp1)):
            model = model.module
        else:
            return None
    return None


def unwrap(model):
    """The transformers model inside PEFT, DataParallel/DDP, an FSDP1 root and a DeepSpeed engine
    (FSDP2 shards in place: the model is its own wrapper)."""
    fsdp1 = _fsdp1_class()
    for _ in range(8):  # wrappers nest (PEFT inside DDP, ...); a few levels at most
        if _is_peft(model):
            model = model.get_base_model()
        elif isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)) or _is_deepspeed_engine(model):
            model = model.module
        elif fsdp1 is not None and isinstance(model, fsdp1):
            model = model.module
        else:
            return model
    return model


def sharding_engine(model: nn.Module) -> str | None:
    """'FSDP1', 'FSDP2' or 'DeepSpeed ZeRO-3' when `model` (or a module inside it) is sharded."""
    fsdp1, fsdp2 = _fsdp1_class(), _fsdp2_class()
    for module in model.modules():
        if fsdp1 is not None and isinstance(module, fsdp1):
            return "FSDP1"
        if fsdp2 is not None and isinstance(module, fsdp2):
            return "FSDP2"
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return "DeepSpeed ZeRO-3"
    return None


def ddp_wrapper_of(model: nn.Module):
    """The DistributedDataParallel that wraps `model`, found from the model's side (a user who
    passes `ddp.module` after wrapping), or None. Only looked for in an initialised process group."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    ddp = nn.parallel.DistributedDataParallel
    frontier = [model]
    for _ in range(3):  # model <- DDP._modules <- (DDP.__dict__ <-) DDP
        referrers = [r for obj in frontier for r in gc.get_referrers(obj)]
        for ref in referrers:
            if isinstance(ref, ddp) and ref.module is model:
                return ref
        frontier = [r for r in referrers if isinstance(r, dict)]
    return None


def _fsdp2_class_of(model):
    """The transformers class under FSDP2's in-place subclass (FSDPLlamaForCausalLM -> LlamaForCausalLM)."""
    fsdp2 = _fsdp2_class()
    cls = type(model)
    if fsdp2 is not None and isinstance(model, fsdp2):
        cls = next(c for c in cls.__mro__[1:] if c is not fsdp2 and not issubclass(c, fsdp2))
    return cls


def model_class(model) -> type:
    """The transformers class of a (possibly wrapped or FSDP2-sharded) model."""
    return _fsdp2_class_of(unwrap(model))


@contextmanager
def full_parameters(model, params: list[torch.Tensor]):
    """Within the block, `full_value(p)` is the whole value of every p in `params` on every rank.

    A collective under FSDP1 and ZeRO-3: call it on every rank, with the same parameters."""
    fsdp1 = _fsdp1_class()
    with ExitStack() as stack:
        if fsdp1 is not None and any(isinstance(m, fsdp1) for m in model.modules()):
            stack.enter_context(fsdp1.summon_full_params(model, writeback=False))
        zero3 = [p for p in params if hasattr(p, "ds_id")]
        if zero3:  # imported by name: transformers refuses remote code (hub.py ships this file) whose
            deepspeed = importlib.import_module("deepspeed")  # plain `import` names a package not installed
            stack.enter_context(deepspeed.zero.GatheredParameters(zero3, modifier_rank=None))
        yield


def full_value(param: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (an FSDP2 DTensor is all-gathered: a collective)."""
    full_tensor = getattr(param, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else param


def full_state_dict(model) -> dict[str, torch.Tensor] | None:
    """The model's complete state dict on CPU, keyed as in the unwrapped transformers model, on
    rank 0 (None on the other ranks); collective under FSDP1, FSDP2 and ZeRO-3."""
    engine = sharding_engine(model)
    rank = torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
    if engine == "FSDP1":
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType

        fsdp1 = _fsdp1_class()
        root = model if isinstance(model, fsdp1) else unwrap(model)
        with fsdp1.state_dict_type(root, StateDictType.FULL_STATE_DICT,
                                   FullStateDictConfig(offload_to_cpu=False, rank0_only=True)):
            state = root.state_dict()
    elif engine == "FSDP2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    elif engine == "DeepSpeed ZeRO-3":
        inner = unwrap(model)
        with full_parameters(inner, list(inner.parameters())):
            state = {k: v.detach().cpu().clone() for k, v in inner.state_dict().items()} if rank == 0 else None
    else:
        state = {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}
    return state if rank == 0 else None


def require_model(model, function: str):
    """The transformers model inside any wrapper, or a TypeError that names what was passed."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"hf_tangent.{function} expects a transformers model (nn.Module), got {type(model).__name__}.")
    base = unwrap(model)
    if getattr(getattr(base, "config", None), "model_type", None) is None:
        raise TypeError(f"hf_tangent.{function} expects a transformers model (a module with config.model_type), got "
                        f"{type(base).__name__}.")
    return base
