"""Coverage of transformers' causal-LM types: build each tiny, patch it, check the patch against an
independent computation, and write the table in docs/architectures.md.

    python tests/architectures.py                 # every type; writes docs/architectures.md
    python tests/architectures.py llama gemma3    # some types, printed only

Per type (2 layers, float32, random weights, norm gains and biases drawn away from 1 and 0):
- `add` (gated, so the hooks are active) gives logits bit-identical to the unpatched model;
- the truth for each layer comes from the weights, not the hooks: r = the layer's output with the
  FFN's parameters zeroed, y = the unpatched output - r;
- `zero` gives exactly r; `projected` gives r + P_x y, with x = r (sequential) or the block input
  (parallel), checked in float64 (relative error < 1e-5) and orthogonal to x to 1e-5;
- `unpatch` is bit-identical to the model before `patch`;
- the FFN and attention roles found must also look like an FFN and a mixer by name: a second opinion,
  reported as "names disagree" rather than trusted.
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
from pathlib import Path

import torch

import hf_tangent as ht

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
             head_dim=16, vocab_size=256, max_position_embeddings=256, n_embd=64, n_layer=2, n_head=4, n_positions=256,
             d_model=64, num_layers=2, ffn_dim=96, n_inner=96, num_heads=4, decoder_layers=2, encoder_layers=2,
             decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=96, encoder_ffn_dim=96,
             num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16,
             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_group=1, topk_group=1,
             d_ff=96, d_kv=16, num_decoder_layers=2, hidden_dim=64, embed_dim=64, dim=64, n_heads=4, n_layers=2,
             ffn_hidden_size=96, multi_query_group_num=2, kv_channels=16, num_expert_group=1, moe_topk=2,
             residual_multiplier=0.5)  # residual-scaled families: a multiplier that is not 1
MAX_PARAMETERS = 100e6  # multimodal types keep a vocabulary of 262k tokens (image token ids)
PROBE_IDS = torch.tensor([[1 + (13 * i + 5) % 200 for i in range(7)]])
DOC = Path(__file__).resolve().parents[1] / "docs" / "architectures.md"

FAMILIES = [  # first match on the model type wins
    ("hybrid / SSM", r"mamba|jamba|bamba|zamba|lfm|falcon_h1|nemotron_h|recurrent|rwkv|xlstm|qwen3_next|qwen3_5|qwen4"
                     r"|kimi_linear|hybrid|minimax|granitemoehybrid|olmo_hybrid|dory|zaya|inkling"),
    ("MoE FFN", r"moe|mixtral|deepseek|dbrx|jetmoe|olmoe|gpt_oss|llama4|phimoe|dots|hunyuan_v1_moe|flex_olmo|longcat"
                r"|mimo|afmoe|axk|sarvam|solar_open|glm4_moe|glm_moe|ernie4_5_moe|exaone_moe|laguna|hy_v|bailing|youtu"),
    ("encoder-decoder / BERT family (post-LN)", r"bert|bart|roberta|electra|ernie$|rembert|roformer|xlm|xmod|camembert"
                                                r"|data2vec|marian|pegasus|blenderbot|plbart|prophetnet|trocr|whisper|mvp"
                                                r"|musicgen|reformer|xlnet|big_bird|megatron|roc_bert|moss|git|got_ocr"),
    ("parallel residual", r"gptj|codegen|falcon$|cohere|phi$|gpt_neox|persimmon|stablelm"),
    ("sandwich norm", r"gemma|olmo2|olmo3|glm4$|exaone4|hyperclovax|vaultgemma"),
]
FFN_NAMES = re.compile(r"mlp|ffn|feed_forward|feedforward|fc2|dense_4h_to_h|moe|expert|c_proj|channel_mix|post_feedforward"
                       r"|intermediate|output\.dense")
MIXER_NAMES = re.compile(r"attn|attention|mixer|mamba|conv|linear_attn|self|time_mix|token_mix|recurrent|ssm|temporal")


def family(model_type: str) -> str:
    return next((name for name, pattern in FAMILIES if re.search(pattern, model_type)), "Llama-like / sequential")


def _ids(config):
    found = []
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "image_token_id", "image_token_index"):
        value = getattr(config, key, None)
        found += value if isinstance(value, list) else [value]
    return [i for i in found if isinstance(i, int)]


EXTRA = {  # what a type's own config validation needs at 2 layers
    "zaya": {"num_experts_per_tok": 1},
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 0, "n_output_layers": 1},
}


def _fit(config, mamba_heads: bool = True) -> dict:
    settable = [k for k in SMALL if hasattr(config, k) and not isinstance(getattr(type(config), k, None), property)]
    small = {k: SMALL[k] for k in settable}
    if mamba_heads and hasattr(config, "mamba_d_head"):  # Mamba-2 heads must tile expand * hidden_size
        small.update(mamba_n_heads=4, mamba_d_head=int(getattr(config, "mamba_expand", 2) * 64 / 4))
    if type(config).__name__ == "Mamba2Config":
        small["head_dim"] = int(config.expand * 64 / small["num_heads"])
    if type(config).__name__ == "GPTNeoConfig":
        small["attention_types"] = [[["global", "local"], 1]]
    if hasattr(config, "qk_rope_head_dim"):  # multi-head latent attention: rope on qk_rope_head_dim
        small["head_dim"] = small["qk_rope_head_dim"]
    if hasattr(config, "rotary_dim"):
        small["rotary_dim"] = 8
    if hasattr(config, "vocab_size"):
        small["vocab_size"] = max([256] + [i + 1 for i in _ids(config)])
    return small


def _per_layer(values: dict, n: int) -> dict:
    """Per-layer lists of a default config cut to 2 layers: the first and the last kind."""
    for key, value in list(values.items()):
        if isinstance(value, list) and len(value) == n and n > 2:
            values[key] = [value[0], value[-1]]
    return values


def tiny_config(model_type: str, mamba_heads: bool = True):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    sub = next((name for name in ("text_config", "decoder_config")
                if hasattr(getattr(default, name, None), "to_dict")), None)
    if sub:
        inner = getattr(default, sub)
        values = _per_layer({**inner.to_dict(), **_fit(inner)}, getattr(inner, "num_hidden_layers", 0))
        return cls(**{sub: values}, **{k: v for k, v in _fit(default).items() if k != "hidden_size"})
    values = default.to_dict()
    n = values.get("num_hidden_layers", 0)
    values.update(_fit(default, mamba_heads), **EXTRA.get(model_type, {}))
    values.pop("attention_layers", None)  # GPT-Neo derives it from attention_types
    for key, value in vars(default).items():  # vision / audio towers of multimodal models: tiny too
        if re.search(r"vision|audio|speech|image|encoder", key) and key.endswith("_config") and hasattr(value, "to_dict"):
            values[key] = _per_layer({**value.to_dict(), **_fit(value)}, getattr(value, "num_hidden_layers", 0))
    for key in ("model_type", "transformers_version"):
        values.pop(key, None)
    return cls(**_per_layer(values, n))


# (model_type, transformers major version): the model's own forward does not finish here at the tiny size
# (transformers 4.57.1's Falcon-H1 Mamba torch path: > 10 min and ~9 GB at 2 layers and d=64)
NOT_BUILT = {("falcon_h1", 4): "transformers 4's Falcon-H1 torch forward takes > 10 min and ~9 GB at the tiny size"}


def build(model_type: str):
    import transformers
    from transformers import AutoModelForCausalLM

    reason = NOT_BUILT.get((model_type, int(transformers.__version__.split(".")[0])))
    if reason:
        raise RuntimeError(f"not built here: {reason}")

    try:
        config = tiny_config(model_type)
    except Exception:  # noqa: BLE001 - some hybrids validate their own Mamba head sizes: keep them
        config = tiny_config(model_type, mamba_heads=False)
    with torch.device("meta"):
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise MemoryError(f"{size / 1e6:.0f}M parameters even at 2 layers and d=64")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norm gains and biases away from 1 and 0, so a misplaced norm shows
        for p in model.parameters():
            if p.dim() == 1 and p.is_floating_point():
                p.uniform_(0.5, 1.5)
        model(input_ids=PROBE_IDS, use_cache=False)  # the model's own forward must run
    return model


def _layer_io(model, layers, ids):
    io = [None] * len(layers)

    def hook(i):
        def record(module, args, kwargs, output):
            if io[i] is None:
                h = args[0] if args else kwargs["hidden_states"]
                io[i] = (h.double(), (output[0] if isinstance(output, tuple) else output).double())
        return record

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits, io


def _ffn_params(spec, layer):
    modules = [spec.submodule(layer, "ffn_out")]
    if spec.mlp:
        with contextlib.suppress(ValueError):  # a hybrid's layer class may have no separate mlp role
            modules.append(spec.submodule(layer, "mlp"))
    return [p for m in modules for p in m.parameters()]


def _check_layer(model, spec, layers, i: int, ids, base) -> list[str]:
    """Layer i alone patched (the layers before it unchanged, so it sees the unpatched input h):
    the truth comes from the weights, not the hooks: r = its output with the FFN's parameters
    zeroed, y = its unpatched output - r, x = r (sequential) or h (parallel)."""
    h, out = base
    saved = [(p, p.detach().clone()) for p in _ffn_params(spec, layers[i])]
    try:
        with torch.no_grad():
            for p, _ in saved:
                p.zero_()
        r = _layer_io(model, layers, ids)[1][i][1]
    finally:
        with torch.no_grad():
            for p, value in saved:
                p.copy_(value)
    y = out - r
    if y.abs().amax() == 0:
        return [f"layer {i}: zeroing the FFN's parameters changes nothing"]
    x = h if spec.is_parallel(layers[i]) else r
    problems = []
    scale = out.abs().amax().item()
    ht.patch(model, ht.TangentConfig(update="zero", layers=[i]))
    zero = _layer_io(model, layers, ids)[1][i][1]
    if (zero - r).abs().amax().item() > 1e-6 * scale:
        problems.append(f"layer {i}: zero is not the residual without the FFN")
    # relative eps 1e-12: the projection is exact to float32 rounding (the default absolute eps is not
    # negligible next to ||x||^2 of a tiny random model)
    ht.patch(model, ht.TangentConfig(update="projected", layers=[i], eps=1e-12, eps_mode="relative"))
    projected = _layer_io(model, layers, ids)[1][i][1]
    ht.unpatch(model)
    expected = r + y - (y * x).sum(-1, keepdim=True) / (x * x).sum(-1, keepdim=True) * x
    if (projected - expected).abs().amax().item() > 1e-5 * scale:
        problems.append(f"layer {i}: projected differs from r + P_x y by {(projected - expected).abs().amax().item() / scale:.1e}")
    # on tokens whose update is not drowned by float32 rounding of the layer output (|u| > 1e-3 |out|)
    update = projected - r
    cosine = (update * x).sum(-1).abs() / (update.norm(dim=-1) * x.norm(dim=-1) + 1e-30)
    cosine = cosine[update.norm(dim=-1) > 1e-3 * out.norm(dim=-1)]
    if cosine.numel() and cosine.amax().item() > 1e-5:
        problems.append(f"layer {i}: projected update not orthogonal to x (|cos| {cosine.amax().item():.1e})")
    return problems


def check_type(model_type: str) -> dict:
    """One row of the coverage table."""
    row = {"type": model_type, "family": family(model_type), "support": "", "verified": False, "note": ""}
    try:
        model = build(model_type)
    except Exception as error:  # noqa: BLE001 - the reason goes into the table
        row.update(support="not built", note=f"{type(error).__name__}: {str(error).splitlines()[0][:90]}")
        return row
    ids = PROBE_IDS
    try:
        spec = ht.core.registry.get_registered(model) or ht.core.discovery.resolve_spec(model)
        layers = spec.decoder_layers(model)
        ht.core.discovery.require_verified(model, spec, layers, needs_attention=[])
    except ValueError as error:
        reason = str(error).split(". hf_tangent patches")[0].split(". hf_tangent")[0]
        reason = reason.split("), ", 1)[-1] if "discovery failed" in reason else reason.split("hf_tangent: ", 1)[-1]
        row.update(support="refused", note=reason.replace("no submodules satisfy out = r + ffn(...) (sequential) or out = "
                                                          "h + attention(h) + ffn(h) (parallel)", "no residual + FFN add")[:200])
        return row
    row["support"] = "registry" if spec.source == "registry" else "discovered"
    problems = []
    base_logits, base_io = _layer_io(model, layers, ids)
    ht.patch(model, ht.TangentConfig(update="add", gates=True))
    if not torch.equal(_layer_io(model, layers, ids)[0], base_logits):
        problems.append("add is not bit-identical")
    ht.unpatch(model)
    if not torch.equal(_layer_io(model, layers, ids)[0], base_logits):
        problems.append("unpatch is not bit-identical")
    for i in range(len(layers)):
        problems += _check_layer(model, spec, layers, i, ids, base_io[i])
    ffn_path, attention_path = spec.mlp or spec.ffn_out_path, spec.attention or ""
    if not FFN_NAMES.search(ffn_path.lower()) or (attention_path and not MIXER_NAMES.search(attention_path.lower())):
        problems.append(f"names disagree (ffn '{ffn_path}', attention '{attention_path}')")
    row["verified"] = not problems
    row["note"] = "; ".join(problems) or _how(spec)
    return row


def _how(spec) -> str:
    parts = ["parallel" if spec.parallel or spec.parallel_attr else "sequential"]
    if spec.ffn_out and spec.mlp:
        parts.append(f"sandwich ({spec.ffn_norm} -> {spec.mlp} -> {spec.ffn_out})")
    else:
        parts.append(f"{spec.ffn_norm} -> {spec.ffn_out_path}")
    if spec.residual_scale:
        parts.append(f"scaled by {spec.residual_scale}")
    if any("|" in (getattr(spec, f) or "") for f in ("attention", "input_norm", "ffn_norm", "mlp", "ffn_out")):
        parts.append("roles differ per layer")
    return ", ".join(parts)


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def table(rows: list[dict]) -> str:
    import transformers

    verified = sum(r["verified"] for r in rows)
    built = sum(r["support"] != "not built" for r in rows)
    lines = [
        "# Architecture coverage",
        "",
        f"Generated by `python tests/architectures.py` with transformers {transformers.__version__}: every type in",
        "`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, built tiny (2 layers, d=64, random weights), patched, and checked",
        "against an independent computation (see the module's docstring). Do not edit by hand.",
        "",
        f"**{verified} of {built} buildable types verified** ({len(rows)} types in the mapping).",
        "",
        "| family | types | verified | refused | not built |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in sorted({r["family"] for r in rows}):
        group = [r for r in rows if r["family"] == name]
        lines.append(f"| {name} | {len(group)} | {sum(r['verified'] for r in group)} | "
                     f"{sum(r['support'] == 'refused' for r in group)} | {sum(r['support'] == 'not built' for r in group)} |")
    lines += ["", "| type | family | how | verified | note |", "|---|---|---|---|---|"]
    for r in rows:
        note = r["note"].replace("|", "\\|")
        lines.append(f"| {r['type']} | {r['family']} | {r['support']} | {'yes' if r['verified'] else 'no'} | {note} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    types = argv or causal_lm_types()
    start, rows = time.time(), []
    for model_type in types:
        t = time.time()
        rows.append(check_type(model_type))
        r = rows[-1]
        print(f"{model_type:28s} {r['support']:10s} {'yes' if r['verified'] else 'no ':3s} {time.time() - t:5.1f}s {r['note'][:100]}",
              flush=True)
    print(f"{sum(r['verified'] for r in rows)} verified of {len(rows)} in {time.time() - start:.0f} s")
    if not argv:
        DOC.write_text(table(rows), encoding="utf-8")
        print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
