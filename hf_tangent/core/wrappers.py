"""What a model may be wrapped in (PEFT, DDP, FSDP1, FSDP2, DeepSpeed) and how to reach the transformers
model inside, where the patch lives (reading whole values through a sharding engine: gather.py)."""

from __future__ import annotations

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
