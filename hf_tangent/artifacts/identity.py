"""Is this the base a patch was made for? Weights (every value of every tensor) and the config
fields that change the computation, recorded when a patch repo is written and compared when it is
loaded.

Weights: one blake2b digest per precision over every base parameter's name, shape and values cast
to that precision. A checkpoint loaded in float32, bfloat16 or float16 is compared at the coarsest
precision either side has (float32 loads at float32; any bfloat16 at bfloat16; any float16 at
float16), where both sides round the same stored values the same way: the digests agree for every
load of one checkpoint, and any changed value (one row of the embedding) changes them. A record
taken from a bfloat16 load cannot be compared with a float16 load (neither precision holds the
other), and says so.
"""

from __future__ import annotations

import hashlib

import torch

from ..core.registry import CONFIG_KEY
from ..core.wrappers import unwrap

METHOD = "hf_tangent-2: blake2b over every base parameter's name, shape and every value, per precision"
METHOD_V1 = "sha256 over every base parameter's name, shape and first / last 1024 values rounded to bfloat16"
PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPES = (*PRECISIONS, "float64")
_AS_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
           torch.float64: torch.int64}
_CHUNK = 1 << 22

# Config fields that never change what the loaded weights compute (names, bookkeeping, generation,
# token ids, output switches, attention kernels, initialisation); every other field is compared.
_NOT_COMPUTATION = {
    "_name_or_path", "_commit_hash", "transformers_version", "architectures", "torch_dtype", "dtype", "use_cache",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16", "pruned_heads",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "id2label", "label2id", "problem_type", "tokenizer_class", "prefix", "bos_token_id", "pad_token_id",
    "eos_token_id", "sep_token_id", "decoder_start_token_id", "task_specific_params", "finetuning_task", "auto_map",
    "hf_tangent", "_attn_implementation", "_attn_implementation_autoset", "attn_implementation",
    "_experts_implementation", "quantization_config", "model_type", "initializer_range", "base_model_tp_plan",
    "base_model_pp_plan", "base_model_ep_plan", "tp_plan", "pp_plan", "output_router_logits", "max_length",
    "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature",
    "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "tf_legacy_loss",
    "cross_attention_hidden_size", "_hf_tangent_base_model_type", "use_return_dict",
}


class BaseIdentityError(ValueError):
    """The base's identity cannot be established (offloaded or quantised weights, incomparable dtypes)."""


def base_parameters(model) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of the base model: adapters and the patch's own parameters left out, a
    PEFT-wrapped layer's `base_layer` counted as the layer."""
    found = []
    for name, param in unwrap(model).named_parameters():
        if "lora_" in name or ".tangent_patch." in name or ".modules_to_save." in name:
            continue  # PEFT's trained copies (modules_to_save) are the adapter's, original_module the base's
        found.append((name.replace(".base_layer", "").replace(".original_module", ""), param))
    return found


def _check_readable(params) -> None:
    meta = [n for n, p in params if p.is_meta]
    if meta:
        raise BaseIdentityError(f"the base's weights are offloaded (on the meta device: {meta[0]}, ... {len(meta)} "
                                "tensors), so they cannot be compared with the record; load the base without "
                                "offloading, or pass skip_base_check=True to skip the identity check.")
    quantised = [n for n, p in params if not p.is_floating_point() or p.dtype not in _AS_INT]
    if quantised:
        raise BaseIdentityError(f"the base's weights are quantised ({quantised[0]} is "
                                f"{dict(params)[quantised[0]].dtype}), so they cannot be compared with the record; "
                                "load the base in float32, bfloat16 or float16, or pass skip_base_check=True to skip "
                                "the identity check.")


def dtypes(model) -> list[str]:
    params = base_parameters(model)
    _check_readable(params)
    return sorted({str(p.dtype).replace("torch.", "") for _, p in params})


def weight_digests(model, precisions) -> dict[str, str]:
    """{precision: hex digest} over every base parameter (see the module docstring)."""
    params = base_parameters(model)
    _check_readable(params)
    hashes = {p: hashlib.blake2b(digest_size=32) for p in precisions}
    with torch.no_grad():
        for name, param in params:
            header = f"{name}:{tuple(param.shape)};".encode()
            for h in hashes.values():
                h.update(header)
            for chunk in param.detach().reshape(-1).split(_CHUNK):
                chunk = chunk.cpu()
                for p, h in hashes.items():
                    dtype = PRECISIONS[p]
                    h.update(chunk.to(dtype).contiguous().view(_AS_INT[dtype]).numpy().tobytes())
    return {p: h.hexdigest() for p, h in hashes.items()}


def recorded_precisions(found: list[str]) -> list[str]:
    """The precisions a record made from a load with parameter dtypes `found` can be compared at."""
    kinds = set(found) - {"float64"}  # float64 holds float32 exactly: it compares like float32
    if kinds <= {"float32"}:
        return ["float32", "bfloat16", "float16"]
    return [p for p in ("bfloat16", "float16") if kinds <= {"float32", p}]


def comparison_precision(recorded: list[str], loaded: list[str]) -> str:
    kinds = (set(recorded) | set(loaded)) - {"float64"}
    for precision, allowed in (("float32", {"float32"}), ("bfloat16", {"float32", "bfloat16"}),
                               ("float16", {"float32", "float16"})):
        if kinds <= allowed:
            return precision
    raise BaseIdentityError(f"the record was taken from a load in {', '.join(recorded)} and the base is loaded in "
                            f"{', '.join(loaded)}: no precision holds both exactly. Load the base in float32 or "
                            f"{recorded[0]} (dtype=...), or pass skip_base_check=True to skip the identity check.")


def fingerprint(model) -> dict:
    """What a patch record keeps of its base's weights."""
    found = dtypes(model)
    if not recorded_precisions(found):
        raise BaseIdentityError(f"the base's parameters mix {', '.join(found)}, which no one precision holds exactly; "
                                "cast the model to one dtype (model.to(torch.bfloat16), ...) before saving the patch")
    return {"method": METHOD, "dtypes": found, "digests": weight_digests(model, recorded_precisions(found))}


SCORED_METHOD = ("blake2b-256 over every parameter's name, dtype, shape and bytes as held (gates and adapters "
                 "included), then the patch record and the config fields that change the computation, as JSON")


def scored_weights(model) -> dict:
    """What a report records of the weights it scored: one digest over every parameter of the model as
    it is (patch gates and LoRA adapters included, in the dtype held) and what else decides what they
    compute (the hf_tangent patch record: rule, alpha, beta, layers, parallel layers, homotopy lambda; the
    model config's computation fields), the parameter count, dtypes and the patch record itself (None:
    not patched), so two reports of one base patched two ways differ and say where. Offloaded (meta)
    parameters cannot be read: the digest is then None, with the reason."""
    import json

    base = unwrap(model)
    params = list(base.named_parameters())
    meta = [n for n, p in params if p.is_meta]
    record = getattr(base.config, CONFIG_KEY, None)
    record = json.loads(json.dumps(record, default=str)) if isinstance(record, dict) else None
    found = {"method": SCORED_METHOD, "parameters": sum(p.numel() for _, p in params),
             "dtypes": sorted({str(p.dtype).replace("torch.", "") for _, p in params}), "patch": record}
    if meta:
        return found | {"digest": None, "why_none": f"{len(meta)} parameters are offloaded (meta), e.g. {meta[0]}"}
    digest = hashlib.blake2b(digest_size=32)
    with torch.no_grad():
        for name, param in params:
            digest.update(f"{name}:{param.dtype}:{tuple(param.shape)};".encode())
            flat = param.detach().reshape(-1)
            for chunk in flat.split(_CHUNK):
                digest.update(chunk.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    digest.update(json.dumps({"patch": record, "config": computation_config(base.config)}, sort_keys=True,
                             default=str).encode())
    return found | {"digest": digest.hexdigest()}


def patch_differences(one, other) -> list[tuple[str, object, object]]:
    """(field, one's value, other's value) where two patch records (scored_weights' "patch"; None: not
    patched) differ, fields dotted (config.update, patched_layers, homotopy.lambda)."""
    if one is None or other is None:
        return [] if one is other else [("patch", "none" if one is None else "a patch", "none" if other is None else
                                          "a patch")]

    def flat(record, prefix=""):
        if not isinstance(record, dict) or not record:
            return {prefix[:-1]: record}
        return {k: v for key, value in record.items() for k, v in flat(value, f"{prefix}{key}.").items()}

    a, b = flat(one, "patch."), flat(other, "patch.")
    return [(k[6:], a.get(k, "(absent)"), b.get(k, "(absent)")) for k in sorted(set(a) | set(b))
            if a.get(k, "(absent)") != b.get(k, "(absent)")]


def fingerprint_v1(model) -> str:
    """The sampled fingerprint of patch format 1 (first / last 1024 values of each tensor), kept to
    check records written by hf_tangent 0.3."""
    digest = hashlib.sha256()
    for name, param in base_parameters(model):
        flat = param.detach().reshape(-1)
        sample = torch.cat([flat[:1024], flat[-1024:]]).to(torch.bfloat16).float().cpu()
        digest.update(f"{name}:{tuple(param.shape)}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def _flatten(data, prefix: str = "") -> dict:
    flat = {}
    for key, value in data.items():
        if key in _NOT_COMPUTATION:
            continue
        # transformers 5 keeps rope settings under rope_parameters, 4.x at the top or in rope_scaling
        name = f"{prefix}{key}" if key not in ("rope_parameters", "rope_scaling") else prefix
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            flat.update(_flatten(value, f"{name}." if name != prefix else prefix))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def computation_config(config) -> dict:
    """The config fields that change what the weights compute, flattened to dotted names."""
    import json

    data = json.loads(config.to_json_string(use_diff=False))  # JSON-safe values (inf as Infinity, tuples as lists)
    return _flatten(data)


def config_differences(recorded: dict, found: dict) -> list[str]:
    """Fields present on both sides whose values differ (a field only one side's transformers knows
    is left out: releases add and rename fields)."""
    return [f"{key}: {recorded[key]!r} (recorded) vs {found[key]!r}" for key in sorted(set(recorded) & set(found))
            if recorded[key] != found[key]]
