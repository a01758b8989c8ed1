"""What the package reads through wrappers and sharding engines: the PEFT model and the transformers class
inside them, and whole values of a sharded model's parameters through the engine's own gathering API (FSDP1
`summon_full_params`, FSDP2 `DTensor.full_tensor`, ZeRO-3 `GatheredParameters`: collectives, every rank calls
them). Not shipped in a saved folder: a patched forward never gathers."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from .wrappers import _fsdp1_class, _is_deepspeed_engine, _is_peft, unwrap


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


def model_class(model) -> type:
    """The transformers class of a (possibly wrapped or FSDP2-sharded) model (under FSDP2's in-place subclass:
    FSDPLlamaForCausalLM -> LlamaForCausalLM)."""
    model, fsdp2 = unwrap(model), _fsdp2_class()
    if fsdp2 is not None and isinstance(model, fsdp2):
        return next(c for c in type(model).__mro__[1:] if c is not fsdp2 and not issubclass(c, fsdp2))
    return type(model)


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


@contextmanager
def full_parameters(model, params: list[torch.Tensor]):
    """Within the block, `full_value(p)` is the whole value of every p in `params` on every rank.

    A collective under FSDP1 and ZeRO-3: call it on every rank, with the same parameters."""
    fsdp1 = _fsdp1_class()
    with ExitStack() as stack:
        if fsdp1 is not None and any(isinstance(m, fsdp1) for m in model.modules()):
            stack.enter_context(fsdp1.summon_full_params(model, writeback=False))
        zero3 = [p for p in params if hasattr(p, "ds_id")]
        if zero3:  # an optional dependency, imported only where ZeRO-3 sharded the model
            import deepspeed
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
