"""The hf_tangent patch as a PEFT method (`TangentPeftConfig` + `TangentModel`), registered with PEFT when
hf_tangent is imported: `get_peft_model`, `PeftModel.from_pretrained`, `AutoPeftModelForCausalLM`,
`model.load_adapter`, `pipeline` and TRL's `SFTTrainer(peft_config=...)` then take it like LoRA or IA3.

PEFT's `register_peft_method` accepts only names of its closed `PeftType` enum (peft#2273), so the
method is entered in the four tables that function fills, under the string key "HF_TANGENT"
(`PeftType` is a `str` enum: PEFT's lookups by a config's `peft_type` string find it). Tested on the
PEFT range pinned in pyproject.toml; `register()` refuses a PEFT whose tables moved.
"""

from __future__ import annotations

from ...core.destinations import ADAPTER_PEFT_TYPE
from .config import PREFIX, TangentPeftConfig
from .model import TangentModel

__all__ = ["TangentModel", "TangentPeftConfig", "register"]


def register() -> None:
    """Enter the method in PEFT's tables (idempotent)."""
    from peft import mapping

    tables = ("PEFT_TYPE_TO_CONFIG_MAPPING", "PEFT_TYPE_TO_TUNER_MAPPING", "PEFT_TYPE_TO_PREFIX_MAPPING")
    missing = [name for name in tables if not isinstance(getattr(mapping, name, None), dict)]
    if missing:
        raise ImportError(f"hf_tangent: this PEFT ({__import__('peft').__version__}) has no {', '.join(missing)} in "
                          "peft.mapping, where hf_tangent registers its PEFT method; install the PEFT range "
                          "hf_tangent is tested on (pyproject.toml).")
    mapping.PEFT_TYPE_TO_CONFIG_MAPPING[ADAPTER_PEFT_TYPE] = TangentPeftConfig
    mapping.PEFT_TYPE_TO_TUNER_MAPPING[ADAPTER_PEFT_TYPE] = TangentModel
    mapping.PEFT_TYPE_TO_PREFIX_MAPPING[ADAPTER_PEFT_TYPE] = PREFIX
