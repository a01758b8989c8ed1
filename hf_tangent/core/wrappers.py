"""What a model may be wrapped in (PEFT, DDP, FSDP1, DeepSpeed; FSDP2 shards in place) and how to reach the
transformers model inside, where the patch lives (the rest of what the package reads through wrappers and
sharding engines: gather.py)."""

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
