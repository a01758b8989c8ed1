"""A hostile-input sweep over the API and the CLI: every case is run and classified as
  ok            a valid input gave the right result
  clear         an invalid input was refused with an error that names what was wrong
  unclear       refused, but the message does not say what is wrong / accepted
  silent wrong  no error, but the result is wrong
  crash         a raw traceback (an unexpected exception type), or a CLI exit other than 2
  half-patched  an error left the model changed

Run: python tests/sweeps/hostile_inputs.py [--output docs/results/hostile_sweep]  (exit 1 on any case that is
not ok / clear). tests/test_hostile_sweep.py runs every group under pytest.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import json
import math
import sys
import tempfile
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import AUSTEN, VOCAB, as_format_2, make_tiny  # noqa: E402

import hf_tangent as ht  # noqa: E402
from hf_tangent import cli  # noqa: E402

IDS = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
RESULTS: list[tuple[str, str, str, str]] = []  # (group, case, outcome, detail)


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def fingerprint(model):
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    record = json.dumps(getattr(model.config, "hf_tangent", None), sort_keys=True, default=str)
    gates = [c.gate.detach().clone() for c in ht.tangent_layers(model) if c.gate is not None]
    return logits(model), hooks, record, gates


def same(a, b) -> bool:
    return (torch.equal(a[0], b[0]) and a[1:3] == b[1:3] and len(a[3]) == len(b[3])
            and all(torch.equal(x, y) for x, y in zip(a[3], b[3], strict=True)))


def record(group, case, outcome, detail=""):
    RESULTS.append((group, case, outcome, detail[:160]))


def expect_error(group, case, fn, message, model=None, kinds=(ValueError, TypeError, AttributeError)):
    """fn() must raise one of `kinds` whose message contains `message`, leaving `model` as it was."""
    before = fingerprint(model) if model is not None else None
    try:
        fn()
    except kinds as err:
        if model is not None and not same(before, fingerprint(model)):
            return record(group, case, "half-patched", str(err))
        return record(group, case, "clear" if message in str(err) else "unclear", str(err))
    except Exception as err:  # noqa: BLE001
        return record(group, case, "crash", f"{type(err).__name__}: {err}")
    record(group, case, "silent wrong", "accepted")


def expect_ok(group, case, fn):
    """fn() returns True when the result is right."""
    try:
        right = fn()
    except Exception as err:  # noqa: BLE001
        return record(group, case, "crash", f"{type(err).__name__}: {err}")
    record(group, case, "ok" if right else "silent wrong")


# ----------------------------------------------------------------------------- config
def config_cases():
    bad = [("update", "tangent"), ("update", None), ("beta", -0.1), ("beta", 1.5), ("beta", "0.5"), ("beta", True),
           ("beta", float("nan")), ("p", 0), ("p", -2), ("p", float("nan")), ("p", "fast"), ("alpha", float("inf")),
           ("alpha", 1e39), ("alpha", "1"), ("eps", 0), ("eps", -1e-6), ("eps", 1e-50), ("eps", 1e39),
           ("eps_mode", "scaled"), ("gamma", -1.0), ("gamma", 1e9), ("noise_h", 0), ("noise_rank", 0),
           ("noise_rank", 2.5), ("noise_rank", 2**63), ("branches", ()), ("branches", ("ffn", "ffn")), ("branches", ("mlp",)),
           ("branches", "ffn"), ("layers", "0,1"), ("layers", [0, 1.5]), ("layers", [True]),
           ("parallel_layers", [None]), ("gates", "yes"), ("implementation", "triton-ish"),
           ("parallel_execution", "threads"), ("retraction", "slerp")]
    for name, value in bad:
        kwargs = {name: value, **({"update": "retract"} if name == "retraction" else {})}
        expect_error("config", f"{name}={value!r}", lambda k=kwargs: ht.TangentConfig(**k), f"TangentConfig.{name}")
    expect_error("config", "retraction with another update", lambda: ht.TangentConfig(update="projected", retraction="cayley"),
                 "TangentConfig.retraction")
    expect_error("config", "retraction='exp', p=1.0", lambda: ht.TangentConfig(update="retract", retraction="exp", p=1.0),
                 "was also given")
    expect_error("config", "from_dict of a list", lambda: ht.TangentConfig.from_dict([1, 2]), "expects a mapping")
    expect_error("config", "set a field of a patched model's config",
                 lambda: setattr(ht.get_config(ht.patch(make_tiny("gpt2"), ht.TangentConfig(update="projected"))), "beta", 0.5),
                 "update_config")


def number_cases(tmp: Path):
    """Issue 46: a number of any kind (numpy scalar, Fraction) is kept as a Python int / float by TangentConfig,
    update_config and the options dataclasses (saves and reports are JSON; the rules see plain floats); a 0-dim
    tensor or array is refused by its type's name; a Fraction beyond float range is no finite number."""
    from fractions import Fraction

    import numpy as np

    def kept(obj, **expected):
        return all(getattr(obj, k) == v and type(getattr(obj, k)) is type(v) for k, v in expected.items())

    given = dict(alpha=np.float32(0.5), beta=Fraction(1, 4), eps=np.float64(2.0**-17), noise_rank=np.int64(3),
                 layers=[np.int64(0)])
    plain = dict(alpha=0.5, beta=0.25, eps=2.0**-17, noise_rank=3, layers=(0,))
    expect_ok("numbers", "TangentConfig of numpy scalars and a Fraction: Python numbers, JSON round trip",
              lambda: kept(ht.TangentConfig(update="soft", **given), **plain) and ht.TangentConfig.from_json_string(
                  ht.TangentConfig(update="soft", **given).to_json_string()) == ht.TangentConfig(update="soft", **plain))

    def same_model_and_saves(implementation):
        ids = torch.randint(0, VOCAB, (20, 6), generator=torch.Generator().manual_seed(1))
        model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="soft", implementation=implementation, **given))
        reference = ht.patch(make_tiny("llama"), ht.TangentConfig(update="soft", implementation=implementation, **plain))
        folder = tmp / f"numbers-{implementation}"
        model.save_pretrained(folder)
        return torch.equal(logits(model, ids), logits(reference, ids)) and \
            ht.get_config(ht.from_pretrained(folder)) == ht.get_config(model)

    for implementation in ("fused", "reference"):
        expect_ok("numbers", f"{implementation}: 20 rows equal the float config's, save_pretrained and reload",
                  lambda i=implementation: same_model_and_saves(i))
    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="soft"))
    def updated():
        ht.update_config(model, beta=np.float32(0.5))
        model.save_pretrained(tmp / "numbers-updated")
        return kept(ht.get_config(model), beta=0.5) and ht.get_config(ht.from_pretrained(tmp / "numbers-updated")).beta == 0.5

    expect_ok("numbers", "update_config(beta=np.float32(0.5)): a float, and the model saves", updated)
    def homotopy_of_numpy():  # set_homotopy refused np.float32 (only int / float were numbers there)
        ht.set_homotopy(model, np.float32(0.25), schedule="linear", steps=np.int64(4))
        saved = model.config.hf_tangent["homotopy"]
        return saved == {"lambda": 0.25, "schedule": "linear", "steps": 4} and type(saved["steps"]) is int

    expect_ok("numbers", "set_homotopy(np.float32(0.25), steps=np.int64(4)): Python numbers in the record", homotopy_of_numpy)
    for value in (torch.tensor(0.5), np.array(0.5), torch.tensor([0.5])):
        expect_error("numbers", f"TangentConfig(alpha={value!r})", lambda v=value: ht.TangentConfig(alpha=v),
                     f"has the wrong type ({type(value).__name__}")
    expect_error("numbers", "update_config(alpha=torch.tensor(0.5))", lambda: ht.update_config(model, alpha=torch.tensor(0.5)),
                 "0-dim: pass .item()", model)
    expect_error("numbers", "TangentConfig(gamma=Fraction(10**400))", lambda: ht.TangentConfig(gamma=Fraction(10**400)),
                 "is out of range; accepted: a number >= 0 and <= 1000")
    expect_ok("numbers", "TangentConfig(update=np.str_('soft')): a str", lambda: type(ht.TangentConfig(
        update=np.str_("soft")).update) is str and ht.TangentConfig(update=np.str_("soft")) == ht.TangentConfig(update="soft"))
    args = dict(output_dir=str(tmp / "numbers-args"), use_cpu=True)
    expect_ok("numbers", "LoraSettings(r=np.int64(2), alpha=np.int32(4)): ints",
              lambda: kept(ht.LoraSettings(r=np.int64(2), alpha=np.int32(4)), r=2, alpha=4))
    expect_ok("numbers", "HealSettings(temperature=np.float32(2), stages=np.int64(2)): Python numbers",
              lambda: kept(ht.HealSettings(temperature=np.float32(2.0), stages=np.int64(2)), temperature=2.0, stages=2))
    expect_ok("numbers", "TangentTrainingArguments(learning_rate=np.float32(0.5), max_steps=np.int64(3)): Python numbers",
              lambda: kept(ht.TangentTrainingArguments(learning_rate=np.float32(0.5), max_steps=np.int64(3), **args),
                           learning_rate=0.5, max_steps=3))
    expect_error("numbers", "LoraSettings(r=np.float32(2))", lambda: ht.LoraSettings(r=np.float32(2.0)),
                 "r=np.float32(2.0) has the wrong type (float32); accepted: an integer >= 1")
    expect_error("numbers", "HealSettings(temperature=torch.tensor(2.0))", lambda: ht.HealSettings(temperature=torch.tensor(2.0)),
                 "0-dim: pass .item()")


# ----------------------------------------------------------------------------- patch
def patch_cases():
    def patched(arch="llama", **kw):
        return ht.patch(make_tiny(arch), ht.TangentConfig(update="projected", gates=True, **kw))

    for arch in ("gpt2", "gpt_neox_sequential", "llama", "mistral"):
        model = patched(arch)
        expect_error("patch", f"{arch}: layer out of range", lambda m=model: ht.patch(m, ht.TangentConfig(layers=[9])),
                     "out of range", model)
        expect_error("patch", f"{arch}: parallel layer out of range",
                     lambda m=model: ht.patch(m, ht.TangentConfig(parallel_layers=[-9])), "out of range", model)
        expect_error("patch", f"{arch}: a dict as config", lambda m=model: ht.patch(m, {"update": "zero"}),
                     "expects a TangentConfig", model)
        cfg = ht.TangentConfig(update="soft", beta=0.5)
        cfg.beta = 7.0
        expect_error("patch", f"{arch}: config mutated to an invalid value", lambda m=model, c=cfg: ht.patch(m, c),
                     "TangentConfig.beta=7.0", model)
        expect_error("patch", f"{arch}: update_config to an invalid value",
                     lambda m=model: ht.update_config(m, beta=3.0), "TangentConfig.beta", model)
    gpt2 = patched("gpt2")
    expect_error("patch", "gpt2: fused parallel execution", lambda: ht.parallelize(gpt2, [1], execution="fused"),
                 "no fused parallel execution path", gpt2)
    compiled = make_tiny("llama")
    compiled.compile()
    expect_error("patch", "model compiled in place", lambda: ht.patch(compiled, ht.TangentConfig(update="zero")),
                 "compiled in place", compiled)
    expect_error("patch", "torch.compile wrapper", lambda: ht.patch(torch.compile(make_tiny("llama")), ht.TangentConfig()),
                 "already torch.compile'd")
    shared = make_tiny("llama")
    shared.model.layers[1] = shared.model.layers[0]
    expect_error("patch", "a layer object listed twice", lambda: ht.patch(shared, ht.TangentConfig(update="zero")),
                 "one module object", shared)
    foreign = make_tiny("llama")
    foreign.model.layers[0].forward = lambda *a, **k: a[0]
    expect_error("patch", "a layer forward replaced on the instance",
                 lambda: ht.patch(foreign, ht.TangentConfig(update="zero")), "forward replaced")
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(make_tiny("llama"), LoraConfig(r=2, target_modules=["q_proj"]))
    expect_error("patch", "a PEFT model", lambda: ht.patch(peft_model, ht.TangentConfig()), "already wrapped by PEFT")
    from transformers import BertConfig, BertForMaskedLM

    bert = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64))
    expect_error("patch", "a post-LN model_type (BERT)", lambda: ht.patch(bert, ht.TangentConfig()),
                 "discovery failed")
    expect_error("patch", "not a model", lambda: ht.patch("gpt2", ht.TangentConfig()), "expects a transformers model")
    expect_error("patch", "update_config of an unpatched model", lambda: ht.update_config(make_tiny("gpt2"), beta=0.5),
                 "not patched")
    expect_error("patch", "homotopy lambda out of [0, 1]",
                 lambda: ht.set_homotopy(ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected")), 1.5),
                 "accepted: a number >= 0 and <= 1 or a mapping.")
    expect_error("patch", "homotopy of an unpatched model", lambda: ht.set_homotopy(make_tiny("llama"), 0.5), "not patched")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import architectures

    def misregistered():  # gemma3 with a Llama spec: the update would land on the attention output's norm
        ht.register_architecture(dataclasses.replace(ht.core.discovery.get_spec("llama"), model_type="gemma3_text"))
        try:
            ht.patch(architectures.build("gemma3_text"), ht.TangentConfig(update="projected"))
        finally:
            ht.core.registry._REGISTRY.pop("gemma3_text")

    expect_error("patch", "a registry entry with the wrong names (Llama names on Gemma 3)", misregistered, "did not verify")


# ----------------------------------------------------------------------------- behaviour
def behaviour_cases():
    from transformers import LlamaConfig, LlamaForCausalLM

    def shared_config():
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1)
        a, b = LlamaForCausalLM(config), LlamaForCausalLM(config)
        ht.patch(a, ht.TangentConfig(update="projected"))
        ht.patch(b, ht.TangentConfig(update="zero"))
        ht.unpatch(b)
        return a.config.hf_tangent["config"]["update"] == "projected" and not hasattr(config, "hf_tangent")

    def live_config():
        cfg = ht.TangentConfig(update="soft", beta=0.5)
        model = ht.patch(make_tiny("llama"), cfg)
        before = logits(model)
        cfg.beta = 1.0
        return torch.equal(logits(model), before) and model.config.hf_tangent["config"]["beta"] == 0.5

    def threads():
        model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="retract", retraction="cayley", parallel_layers=[1]))
        inputs = [torch.randint(0, VOCAB, (1, 5 + i)) for i in range(6)]
        expected = [logits(model, x) for x in inputs]
        wrong = []

        def worker():
            for k in range(30):
                if not torch.equal(logits(model, inputs[k % 6]), expected[k % 6]):
                    wrong.append(k)

        workers = [threading.Thread(target=worker) for _ in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return not wrong

    def stale_x():  # after a forward, the FFN alone is the plain FFN; the (norm, FFN) pair uses its own x
        from hf_tangent.core.rules import residual_delta

        model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected"))
        layer, h = model.model.layers[0], torch.randn(1, 3, 64)
        with torch.no_grad():
            model(IDS)
            alone = layer.mlp(layer.post_attention_layernorm.forward(h))
            pair = layer.mlp(layer.post_attention_layernorm(h))
            ht.unpatch(model)
            plain = layer.mlp(layer.post_attention_layernorm(h))
            return torch.equal(alone, plain) and bool((pair - residual_delta(h, plain, "projected")).abs().max() < 1e-6)

    def nan_token():
        model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected", eps_mode="relative"))
        clean = logits(model)
        handle = model.model.embed_tokens.register_forward_hook(
            lambda m, a, o: o.index_put((torch.tensor([0]), torch.tensor([2])), torch.tensor(float("nan"))))
        out = logits(model)
        handle.remove()
        return torch.equal(out[1], clean[1])

    def zero_state():
        x, y = torch.zeros(2, 8), torch.randn(2, 8)
        return torch.equal(ht.core.fused.fused_residual_delta(x, y, "retract", p=2.0), torch.zeros(2, 8)) and \
            torch.equal(ht.core.rules.residual_delta(x, y, "retract", p=2.0), torch.zeros(2, 8))

    def fp16_overflow():
        x = torch.randn(4, 64) * 1000
        x[:, 0] = 40000.0
        y = torch.randn(4, 64) * 16000
        return torch.isfinite(x.half() + ht.core.rules.residual_delta(x.half(), y.half(), "retract", p=math.inf)).all().item()

    def atomic_repatch():
        model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected", gates=True))
        with torch.no_grad():
            ht.tangent_layers(model)[0].gate.fill_(0.25)
        before = fingerprint(model)
        with contextlib.suppress(ValueError):
            ht.patch(model, ht.TangentConfig(update="zero", layers=[7]))
        return same(before, fingerprint(model))

    def disabled_is_exact():
        model = make_tiny("gpt2")
        plain = logits(model)
        ht.patch(model, ht.TangentConfig(update="projected", gates=True))
        with ht.disabled(model):
            inside = logits(model)
        return torch.equal(inside, plain) and ht.get_config(model) is not None

    def deepcopy_independent():
        model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected", gates=True))
        clone = copy.deepcopy(model)
        with torch.no_grad():
            ht.tangent_layers(clone)[0].gate.fill_(0.0)
        return not torch.equal(logits(clone), logits(model)) and clone.config is not model.config

    for name, fn in [("two models from one config", shared_config), ("caller's config changed after patch", live_config),
                     ("two threads, one model", threads), ("standalone FFN after a forward", stale_x),
                     ("NaN token under relative eps", nan_token), ("retract at x = 0", zero_state),
                     ("fp16 retraction near the range", fp16_overflow), ("failed re-patch keeps gates", atomic_repatch),
                     ("ht.disabled is exact", disabled_is_exact), ("deepcopy gives an independent patch", deepcopy_independent)]:
        expect_ok("behaviour", name, fn)
    for arch in ("gpt2", "gpt_neox_parallel", "gpt_neox_sequential", "llama", "mistral"):
        def roundtrip(arch=arch):
            model = make_tiny(arch)
            plain = logits(model)
            ht.patch(model, ht.TangentConfig(update="retract", retraction="cayley", gates=True))
            ht.unpatch(model)
            return torch.equal(logits(model), plain)

        expect_ok("behaviour", f"{arch}: unpatch is bit-identical", roundtrip)


# ----------------------------------------------------------------------------- reload
def reload_cases(tmp: Path):
    from safetensors.torch import load_file, save_file

    def fresh(name):
        folder = tmp / name
        ht.patch(make_tiny("llama"), ht.TangentConfig(update="soft", beta=0.3, layers=[0, 2], gates=True)).save_pretrained(folder)
        return folder

    def edit(folder, fn):
        data = json.loads((folder / "config.json").read_text())
        fn(data)
        (folder / "config.json").write_text(json.dumps(data))

    records = {
        "record is a list": (lambda d: d.update(hf_tangent=[1]), "must be a mapping"),
        "no config": (lambda d: d["hf_tangent"].pop("config"), "'hf_tangent.config' is missing"),
        "no model_type": (lambda d: d["hf_tangent"].pop("model_type"), "'hf_tangent.model_type' is missing"),
        "num_layers a string": (lambda d: d["hf_tangent"].update(num_layers="3"), "'hf_tangent.num_layers' must be"),
        "num_layers 0": (lambda d: d["hf_tangent"].update(num_layers=0), "must be >= 1"),
        "num_layers wrong": (lambda d: d["hf_tangent"].update(num_layers=30), "saved for 30 layers"),
        "model_type wrong": (lambda d: d["hf_tangent"].update(model_type="gpt2"),
                             "is neither the patch's base model_type 'gpt2'"),
        "patched_layers strings": (lambda d: d["hf_tangent"].update(patched_layers=["0"]), "must list layer indices"),
        "patched_layers wider than config.layers": (lambda d: d["hf_tangent"]["config"].update(layers=[0]), "disagrees"),
        "gates false, gates saved": (lambda d: d["hf_tangent"]["config"].update(gates=False), "config.gates is false"),
        "parallel_layers disagree": (lambda d: d["hf_tangent"].update(parallel_layers=[1]), "disagrees"),
        "beta out of range": (lambda d: d["hf_tangent"]["config"].update(beta=3.0), "TangentConfig.beta=3.0"),
        "p a word": (lambda d: d["hf_tangent"]["config"].update(p="fast"), "TangentConfig.p='fast'"),
        "p '1e400' (a string float() reads as inf)": (lambda d: d["hf_tangent"]["config"].update(p="1e400"),
                                                     "TangentConfig.p='1e400' has the wrong type (str)"),
        "p ' 2.0 '": (lambda d: d["hf_tangent"]["config"].update(p=" 2.0 "), "TangentConfig.p=' 2.0 ' has the wrong type"),
        "config a list": (lambda d: d["hf_tangent"].update(config=[1]), "'hf_tangent.config' must be a dict"),
        "layer index out of range": (lambda d: d["hf_tangent"]["config"].update(layers=[0, 7]), "out of range"),
        "homotopy lambda 2": (lambda d: d["hf_tangent"].update(homotopy={"lambda": 2.0}), "'hf_tangent.homotopy' must be"),
        "homotopy schedule unknown": (lambda d: d["hf_tangent"].update(homotopy={"lambda": 0.5, "schedule": "cubic"}),
                                      "'hf_tangent.homotopy' must be"),
        "architecture spec damaged": (lambda d: d["hf_tangent"].update(architecture={"model_type": "llama", "bogus": 1}),
                                      "'hf_tangent.architecture' is not an architecture spec"),
    }
    for i, (case, (change, message)) in enumerate(records.items()):
        folder = fresh(f"r{i}")
        edit(folder, change)
        expect_error("reload", case, lambda f=folder: ht.from_pretrained(f), message)
    folder = fresh("json")
    (folder / "config.json").write_text("{not json")
    expect_error("reload", "config.json not JSON", lambda: ht.from_pretrained(folder), "not a valid JSON file")
    folder = fresh("bytes")
    (folder / "model.safetensors").write_bytes(b"\x00" * 32)
    expect_error("reload", "damaged safetensors", lambda: ht.from_pretrained(folder), "not a readable safetensors file")
    for case, mutate, message in [
        ("gate of shape (3,)", lambda w: w.update({"model.layers.0.tangent_patch.gate": torch.ones(3)}), "shape (1,)"),
        ("integer gate", lambda w: w.update({"model.layers.0.tangent_patch.gate": torch.ones(1, dtype=torch.int64)}),
         "floating-point gate"),
        ("a gate missing", lambda w: w.pop("model.layers.2.tangent_patch.gate"), "gates are saved for layers [0]"),
        ("a base weight missing", lambda w: w.pop("model.layers.1.mlp.up_proj.weight"), "missing from the weights"),
        ("a foreign weight", lambda w: w.update({"model.extra.weight": torch.ones(1)}), "not in the model"),
    ]:
        folder = fresh(case.replace(" ", "_"))
        weights = load_file(folder / "model.safetensors")
        mutate(weights)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        expect_error("reload", case, lambda f=folder: ht.from_pretrained(f), message)
    expect_error("reload", "not a folder", lambda: ht.from_pretrained(tmp / "nowhere"), "not a saved model folder")
    plain = tmp / "plain"
    make_tiny("gpt2").save_pretrained(plain)
    expect_error("reload", "folder without a patch", lambda: ht.from_pretrained(plain), "holds no hf_tangent patch")

    def old_scalar_gates():
        folder = fresh("scalar")
        weights = load_file(folder / "model.safetensors")
        for key in [k for k in weights if k.endswith(".gate")]:
            weights[key] = weights[key].reshape(())
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        return [tuple(c.gate.shape) for c in ht.tangent_layers(ht.from_pretrained(folder))] == [(1,), (1,)]

    expect_ok("reload", "0-dim gates of older releases load", old_scalar_gates)


# ----------------------------------------------------------------------------- CLI
def cli_cases(tmp: Path, model_folder: Path):
    emma = str(AUSTEN / "emma.txt")
    common = ["--model", str(model_folder), "--seq-len", "16", "--max-windows", "1", "--output-dir", str(tmp / "o")]
    (tmp / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp / "file").write_text("x")
    recipes = {"not_yaml": "a: [1\n", "list": "- 1\n", "quoted_bool": "save_patch: \"false\"\n", "bad_int": "max_steps: x\n",
               "unknown": "max_step: 3\n", "other_command": "command: eval\n", "bad_choice": "compare_updates: [nope]\n",
               "float_for_int": "seq_len: 2.5\n", "scalar_for_list": "layers: 3\n"}
    for name, text in recipes.items():
        (tmp / f"{name}.yaml").write_text(text)
    cases = [
        (["eval", *common, "--device", "cuda"], "eval", "CUDA is not available" if not torch.cuda.is_available() else "SKIP"),
        (["eval", *common, "--device", "quantum"], "eval", "is not a device"),
        (["eval", *common, "--text-files", str(tmp / "latin1.txt")], "eval", "is not UTF-8 text"),
        (["eval", *common, "--text-files", str(tmp / "missing.txt")], "eval", "text files not found"),
        (["eval", *common, "--output-dir", str(tmp / "file")], "eval", "is a file, not a folder"),
        (["eval", *common, "--seq-len", "1"], "eval", "is out of range; accepted: an integer >= "),
        (["eval", *common, "--seq-len", "500"], "eval", "exceeds the model's context"),
        (["eval", *common, "--max-windows", "0"], "eval", "is out of range; accepted: an integer >= "),
        (["eval", *common, "--updates", "nope"], "eval", "invalid choice"),
        (["eval", *common, "--dtype", "float8"], "eval", "invalid choice"),
        (["eval", *common, "--max-window", "1"], "eval", "unrecognized arguments"),
        (["eval", *common, "--text-files", emma, "--dataset", "wikitext-2"], "eval", "not both"),
        (["eval", "--model", str(tmp / "no_model"), "--output-dir", str(tmp / "o")], "eval", "could not load model"),
        (["ablate", *common, "--bootstrap", "0"], "ablate", "is out of range; accepted: an integer >= 1"),
        (["ablate", *common, "--variants", "everything"], "ablate", "invalid choice"),
        (["diagnose", *common, "--update", "nope"], "diagnose", "invalid choice"),
        (["diagnose", *common, "--layers", "x"], "diagnose", "'x' has the wrong type; accepted: a non-empty list of integers >= 0"),
        (["sensitivity", *common, "--text-files", emma], "sensitivity", "unrecognized arguments: --text-files"),
        (["parallel-sweep", *common, "--calibration-windows", "0"], "parallel-sweep", "is out of range; accepted: an integer >= 1"),
        (["calibrate", *common, "--layers", "9"], "calibrate", "out of range"),
        (["calibrate", *common, "--update", "tangent"], "calibrate", "TangentConfig.update='tangent'"),
        (["calibrate", *common, "--resume-from-checkpoint", "last"], "calibrate", "no complete checkpoint"),
        (["calibrate", *common, "--push-to-hub"], "calibrate", "needs --hub_model_id"),
        (["finetune", *common, "--method", "qlora"], "finetune", "invalid choice"),
        *[(["calibrate", *common, "--recipe", str(tmp / f"{n}.yaml")], "calibrate", m) for n, m in [
            ("not_yaml", "not valid YAML"), ("list", "must be a YAML mapping"),
            ("quoted_bool", "save_patch='false' has the wrong type (str); accepted: true or false."),
            ("bad_int", "max_steps='x' has the wrong type (str); accepted: an integer >= 1."),
            ("unknown", "is not an option"), ("other_command", "is for `eval`"),
            ("bad_choice", "compare_updates='nope' is not one of the choices; accepted: one of 'unpatched', 'add',"),
            ("float_for_int", "seq_len=2.5 has the wrong type (float); accepted: an integer >= 2."),
            ("scalar_for_list", "layers=3 has the wrong type (int); accepted: a non-empty list of integers")]],
        (["calibrate", *common, "--recipe", "no_such_recipe"], "calibrate", "not found"),
    ]
    for argv, command, message in cases:
        if message == "SKIP":
            continue
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                code = cli.main(argv)
        except SystemExit as exit_:
            code = exit_.code
        except Exception as exc:  # noqa: BLE001
            record("cli", " ".join(argv[:1] + argv[-2:]), "crash", f"{type(exc).__name__}: {exc}")
            continue
        lines = err.getvalue().strip().splitlines()
        last = lines[-1] if lines else ""
        case = f"{command}: {message}"
        if code != 2:
            record("cli", case, "silent wrong" if code == 0 else "crash", f"exit {code}: {last}")
        elif last.startswith(f"hf-tangent {command}: error: ") and message in last:
            record("cli", case, "clear", last)
        else:
            record("cli", case, "unclear", last)


# ----------------------------------------------------------------------------- surfaces added in round 3
def patched_tiny(**fields):
    model = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected", gates=True, **fields))
    with torch.no_grad():
        ht.tangent_layers(model)[0].gate.fill_(0.75)
    return model


def homotopy_cases():
    model = patched_tiny()
    for value, message in [(1.5, "accepted: a number >= 0 and <= 1 or a mapping."), (-0.1, "accepted: a number >= 0 and <= 1 or a mapping."),
                           (float("nan"), "accepted: a number >= 0 and <= 1 or a mapping."), ("0.5", "accepted: a number >= 0 and <= 1 or a mapping."),
                           (True, "accepted: a number >= 0 and <= 1 or a mapping."), ({0: 0.5}, "accepted: exactly the patched layers"),
                           ({0: 0.5, 1: 0.5, 2: 2.0}, "lambda[2]=2.0 is out of range; accepted: a number >= 0 and <= 1."),
                           ({"x": 0.5, 1: 0.5, 2: 0.5}, "accepted: layer index -> number in [0, 1]")]:
        expect_error("homotopy", f"lambda {value!r}", lambda v=value: ht.set_homotopy(model, v), message, model)
    expect_error("homotopy", "schedule 'cubic'", lambda: ht.set_homotopy(model, 0.5, schedule="cubic"),
                 "schedule='cubic' is not one of the choices; accepted: one of 'linear', 'cosine', or None.", model)
    expect_error("homotopy", "steps -1", lambda: ht.set_homotopy(model, 0.5, steps=-1), "accepted: an integer >= 0", model)
    expect_error("homotopy", "unpatched model", lambda: ht.set_homotopy(make_tiny("llama"), 0.5), "not patched")
    expect_ok("homotopy", "get_homotopy of an unpatched model is None", lambda: ht.get_homotopy(make_tiny("llama")) is None)

    def endpoints():
        plain = make_tiny("llama")
        reference = logits(plain)
        m = ht.set_homotopy(ht.patch(plain, ht.TangentConfig(update="retract", p=2.0)), 0.0)
        return torch.equal(logits(m), reference)

    expect_ok("homotopy", "lambda 0 is bit-identical to the unpatched model", endpoints)
    fused = ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected", parallel_layers=[0],
                                                         parallel_execution="fused"))
    for value in (0.5, 0.0, {0: 0.9, 1: 1.0, 2: 1.0}):
        expect_error("homotopy", f"lambda {value!r} on a fused parallel layer", lambda v=value: ht.set_homotopy(fused, v),
                     "run with parallel_execution='fused' (one GEMM reads the block input); accepted: lambda 1", fused)
    blended = ht.set_homotopy(ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected", parallel_layers=[0])), 0.5)
    expect_error("homotopy", "update_config to fused parallel execution at lambda 0.5",
                 lambda: ht.update_config(blended, parallel_execution="fused"),
                 "update_config: homotopy lambda [0.5] on layers [0]", blended)


def disabled_cases():
    model = patched_tiny()
    for name, call, message in [
        ("patch inside disabled", lambda: ht.patch(model, ht.TangentConfig(update="zero")), "inside `with hf_tangent.disabled"),
        ("unpatch inside disabled", lambda: ht.unpatch(model), "inside `with hf_tangent.disabled"),
        ("update_config inside disabled", lambda: ht.update_config(model, alpha=0.5), "inside `with hf_tangent.disabled"),
        ("set_homotopy inside disabled", lambda: ht.set_homotopy(model, 0.5), "inside `with hf_tangent.disabled"),
    ]:
        before = fingerprint(model)
        with ht.disabled(model):
            expect_error("disabled", name, call, message)
        record("disabled", f"{name}: the patch after the block", "ok" if same(before, fingerprint(model)) else "half-patched")
    expect_error("disabled", "disabled(None)", lambda: ht.disabled(None).__enter__(), "expects a transformers model")

    def exception_inside():
        before = fingerprint(model)
        with contextlib.suppress(RuntimeError), ht.disabled(model):
            raise RuntimeError("boom")
        return same(before, fingerprint(model))

    expect_ok("disabled", "an exception inside the block", exception_inside)


def update_config_cases():
    for value in (0.4, {0: 0.2, 1: 0.9, 2: 0.4}):
        def keeps_lambda(value=value):
            model = ht.set_homotopy(patched_tiny(), value)
            ht.update_config(model, alpha=0.9)
            reference = ht.set_homotopy(ht.patch(make_tiny("llama"), ht.TangentConfig(update="projected", gates=True,
                                                                                      alpha=0.9)), value)
            with torch.no_grad():
                ht.tangent_layers(reference)[0].gate.fill_(0.75)
            return ht.get_homotopy(model) == value and torch.equal(logits(model), logits(reference))

        expect_ok("update_config", f"lambda {value} kept across update_config", keeps_lambda)
    model = ht.set_homotopy(patched_tiny(), {0: 0.2, 1: 0.9, 2: 0.4})
    expect_error("update_config", "per-layer lambda and new layers", lambda: ht.update_config(model, layers=[0]),
                 "per-layer homotopy lambda", model)
    expect_error("update_config", "unknown field", lambda: ht.update_config(model, betta=0.5), "unknown TangentConfig fields",
                 model)
    expect_error("update_config", "invalid value", lambda: ht.update_config(model, p=-1.0), "TangentConfig.p", model)
    expect_error("update_config", "a non-model", lambda: ht.update_config(torch.nn.Linear(2, 2), alpha=0.5),
                 "expects a transformers model")


def register_cases():
    names = dict(layers="model.layers", input_norm=None, attention=None, ffn_norm="post_attention_layernorm", mlp="mlp")
    for field, value in [("model_type", 123), ("model_type", ""), ("layers", None), ("ffn_norm", 3), ("mlp", ["mlp"]),
                         ("parallel", "yes"), ("fused_ffn_in", "mlp.up_proj"), ("source", "guessed"), ("mlp", "  "),
                         ("fused_ffn_in", ("mlp.up_proj", ""))]:
        fields = {"model_type": "hostile_type", **names, field: value}
        expect_error("register", f"{field}={value!r}", lambda f=fields: ht.register_architecture(**f),
                     f"ArchitectureSpec.{field}")
    expect_error("register", "unknown field", lambda: ht.register_architecture(model_type="hostile_type", bogus=1, **names),
                 "unknown fields ['bogus']")
    expect_error("register", "a dict as spec", lambda: ht.register_architecture({"model_type": "x"}), "expects an ArchitectureSpec")
    expect_error("register", "an existing type", lambda: ht.register_architecture(model_type="llama", **names),
                 "already registered")
    expect_ok("register", "the registry still lists its types", lambda: "llama" in ht.supported_model_types()
              and "hostile_type" not in ht.supported_model_types())


def describe_cases():
    for name, value in [("None", None), ("a Linear", torch.nn.Linear(2, 2)), ("a string", "gpt2")]:
        expect_error("describe", f"describe({name})", lambda v=value: ht.describe(v), "expects a transformers model")
        expect_error("describe", f"unpatch({name})", lambda v=value: ht.unpatch(v), "expects a transformers model")
        expect_error("describe", f"get_config({name})", lambda v=value: ht.get_config(v), "expects a transformers model")
    expect_ok("describe", "describe a patched model", lambda: "verified" in ht.describe(patched_tiny()))


def analysis_cases(tmp: Path, folder: Path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = ht.TextSource(text_files=(str(AUSTEN / "emma.txt"),), calibration_files=(str(AUSTEN / "prideprejudice.txt"),))
    small = dict(tokenizer=tokenizer, text=text, seq_len=16, max_windows=1, progress=False)

    def patched_folder_model():
        model = ht.patch(LlamaForCausalLM.from_pretrained(folder).eval(), ht.TangentConfig(update="projected", gates=True))
        return ht.set_homotopy(model, 0.4)

    for name, kwargs in [("pressure", dict(factors=[0.5], variants=["full"])), ("critical", dict(
            layers=[0], fields=["attention"], random_starts=2, token_starts=0, steps=2)), ("ffn_jacobian", dict(
            layers=[0], tokens=2)), ("ablate", dict(variants=["full", "zero_ffn"], bootstrap=10)),
            ("layer_sensitivity", {})]:
        model = patched_folder_model()
        expect_error("analysis", f"{name} on a patched model", lambda n=name, m=model, k=kwargs: getattr(ht, n)(m, **small, **k),
                     "works on the unpatched model", model)
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    for name, kwargs, message in [
        ("critical", dict(threshold=0.0), "threshold=0.0 is out of range"),
        ("critical", dict(threshold=-0.1), "threshold=-0.1 is out of range"),
        ("critical", dict(rel_tol=-1.0), "rel_tol=-1.0 is out of range"),
        ("critical", dict(steps=0), "steps=0 is out of range"),
        ("pressure", dict(factors=[-1.0]), "factors=[-1.0] is out of range"),
        ("ffn_jacobian", dict(tokens=0), "tokens=0 is out of range"),
        ("ablate", dict(bootstrap=0), "bootstrap=0 is out of range"),
        ("parallel_sweep", dict(calibration_windows=0), "calibration_windows=0 is out of range"),
        ("evaluate_rules", dict(seq_len=1), "seq_len=1 is out of range"),
    ]:
        expect_error("analysis", f"{name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})",
                     lambda n=name, k=kwargs: getattr(ht, n)(model, **(small | k)), message, model)

    def diagnose_leaves_it_unpatched():
        m = LlamaForCausalLM.from_pretrained(folder).eval()
        before = fingerprint(m)
        ht.diagnose_layers(m, update="projected", **small)
        return same(before, fingerprint(m))

    expect_ok("analysis", "diagnose --update on an unpatched model leaves it unpatched", diagnose_leaves_it_unpatched)


def heal_cases(tmp: Path, folder: Path):
    from hf_tangent.experiments.heal import HealSettings, HealTrainingArguments

    for fields, message in [(dict(stages=2, homotopy_fraction=0.0), "stages=2 with homotopy_fraction=0"),
                            (dict(stages=0), "stages=0 is out of range"), (dict(temperature=0.0), "temperature=0.0 is out"),
                            (dict(temperature=1e308), "temperature=1e+308 is out of range; accepted: a number > 0 and <= 100"),
                            (dict(lm_weight=1.5), "lm_weight=1.5 is out of range"), (dict(method="qlora"), "accepted: one of 'lora', 'full'"),
                            (dict(homotopy_fraction=-0.5), "homotopy_fraction=-0.5 is out of range"),
                            (dict(schedule="cubic"), "schedule='cubic' is not one of the choices; accepted: one of 'linear', 'cosine'.")]:
        expect_error("heal", f"HealSettings({fields})", lambda f=fields: HealSettings(**f), message)
    args = HealTrainingArguments(output_dir=str(tmp / "heal"), max_steps=2, use_cpu=True)
    text = ht.TextSource(text_files=(str(AUSTEN / "emma.txt"),), calibration_files=(str(AUSTEN / "prideprejudice.txt"),))
    expect_error("heal", "more stages than patched layers", lambda: ht.heal(
        str(folder), ht.TangentConfig(update="projected", layers=[0]), text=text, settings=HealSettings(stages=2),
        seq_len=16, max_windows=1, train_windows=1, training_args=args), "stages=2 > the 1 patched layers")
    expect_error("heal", "fewer homotopy steps than stages", lambda: ht.heal(
        str(folder), ht.TangentConfig(update="projected"), text=text, settings=HealSettings(stages=2, homotopy_fraction=0.5),
        seq_len=16, max_windows=1, train_windows=1, training_args=args), "needs at least 2 homotopy steps")
    expect_error("heal", "a dict as the patch", lambda: ht.heal(str(folder), {"update": "projected"}),
                 "accepted: a TangentConfig")
    expect_ok("heal", "ht.heal is callable twice", lambda: callable(ht.heal) and callable(ht.heal)
              and not isinstance(ht.heal, type(ht)))
    # the offline corpus option (TextSource.corpus) and the corpus API
    from hf_tangent.training import corpora

    for case, fn, message in [
            ("TextSource(corpus='wiki')", lambda: ht.TextSource(corpus="wiki"), "corpus"),
            ("TextSource(corpus=3)", lambda: ht.TextSource(corpus=3), "corpus"),
            ("TextSource(corpus='mixed', text_files=...)", lambda: ht.TextSource(
                corpus="mixed", text_files=(str(AUSTEN / "emma.txt"),)), "text_files given too"),
            ("domain_documents('wikipedia', 'train')", lambda: corpora.domain_documents("wikipedia", "train"),
             "unknown corpus domain 'wikipedia'; accepted: austen, "),
            ("domain_documents('austen', 'test')", lambda: corpora.domain_documents("austen", "test"),
             "unknown corpus split 'test'; accepted: train, heldout"),
            ("mixed_documents('train', 'austen') (a string, not a list)",
             lambda: corpora.mixed_documents("train", "austen"), "not the string 'austen'")]:
        expect_error("heal", case, fn, message)
    expect_ok("heal", "TextSource(corpus='mixed') trains on every domain and holds out every domain",
              lambda: list(ht.TextSource(corpus="mixed").training_domains()) == list(corpora.DOMAINS)
              == list(ht.TextSource(corpus="austen").evaluation_domains(training=True, every_domain=True)))


def adapters_cases(tmp: Path, folder: Path):
    """Patch repos (save_patch / from_pretrained / export_full_folder): damaged or mismatched repos are one
    clear error, in the format save_patch writes (3) and in the one hf_tangent 0.4 wrote (2, conftest.as_format_2);
    an existing folder survives a failed save."""
    from transformers import LlamaForCausalLM

    from hf_tangent.artifacts.patch_repo import export_full_folder

    def gated():
        model = ht.patch(LlamaForCausalLM.from_pretrained(folder).eval(), ht.TangentConfig(update="projected", gates=True))
        with torch.no_grad():
            ht.tangent_layers(model)[0].gate.fill_(0.5)
        return model

    records = {3: "adapter_config.json", 2: "hf_tangent_patch.json"}  # save_patch's format; 0.4's, still read

    def edited(name, change, fmt):
        target = ht.save_patch(gated(), tmp / "patches" / f"{name} ({fmt})")
        if fmt == 2:
            as_format_2(target)
        record = json.loads((target / records[fmt]).read_text())
        change(record)
        (target / records[fmt]).write_text(json.dumps(record))
        return target

    def tangent(r):  # TangentConfig's fields: adapter_config.json's 'patch' (3), hf_tangent_patch.json's 'patch.config' (2)
        return r["patch"] if "peft_type" in r else r["patch"]["config"]

    unpatched = LlamaForCausalLM.from_pretrained(folder).eval()
    expect_error("adapters", "save_patch of an unpatched model", lambda: ht.save_patch(unpatched, tmp / "p0"),
                 "expects a model patched", unpatched)
    expect_error("adapters", "save_patch with a model as the folder", lambda: ht.save_patch(gated(), unpatched),
                 "", kinds=(TypeError,))
    for case, change, message, *formats in [
            ("format 4", lambda r: r.update(format=4), "reads formats 1 to 3: upgrade"),
            ("format '1'", lambda r: r.update(format="1"), "field 'format' must be an integer"),
            ("base as a string", lambda r: r.update(base="HuggingFaceTB/SmolLM2-135M"), "field 'base' must be a JSON object"),
            ("base.num_layers '2'", lambda r: r["base"].update(num_layers="2"), "field 'base.num_layers' must be an integer"),
            ("base.fingerprint 'abc'", lambda r: r["base"].update(fingerprint="abc"), "field 'base.fingerprint' must be"),
            ("base.fingerprint null", lambda r: r["base"].update(fingerprint=None), "records no fingerprint"),
            ("base.config a list", lambda r: r["base"].update(config=[]), "field 'base.config' must be a JSON object"),
            ("alpah in the patch", lambda r: tangent(r).update(alpah=0.5), "unknown keys ['alpah']"),
            ("an unknown field", lambda r: r.update(extra=1), "unknown field(s) ['extra']"),
            ("base.source 'ftp'", lambda r: r["base"].update(source="ftp"), "accepted: 'hub', 'local', 'offline'"),
            ("beta=2 in the patch", lambda r: tangent(r).update(beta=2.0), "TangentConfig.beta"),
            ("gates='weights.bin'", lambda r: r.update(gates="weights.bin"), "accepted: 'gates.safetensors' or null", (2,)),
            ("gates='weights.bin'", lambda r: tangent(r).update(gates="weights.bin"), "TangentConfig.gates", (3,)),
            ("adapters='lora'", lambda r: r.update(adapters="lora"), "accepted: 'adapter' or null", (2,)),
            ("lora='lora'", lambda r: r.update(lora="lora"), "='lora'; accepted: 'adapter' or null", (3,)),
            ("patched_layers [0]", lambda r: r["patch"].update(patched_layers=[0]), "disagrees with the patch's config", (2,)),
            ("num_layers 3", lambda r: r["base"].update(num_layers=3), "num_layers 3 (recorded) vs 2"),
            ("another fingerprint", lambda r: r["base"]["fingerprint"]["digests"].update(float32="0" * 64), "the weights differ"),
            ("another eps in the base config", lambda r: r["base"]["config"].update(rms_norm_eps=0.5), "rms_norm_eps")]:
        for fmt in formats[0] if formats else (3, 2):
            expect_error("adapters", f"record (format {fmt}): {case}",
                         lambda c=case, f=change, v=fmt: ht.from_pretrained(edited(c, f, v)), message)
    for fmt, weights in ((3, "adapter_model.safetensors"), (2, "gates.safetensors")):
        damaged = ht.save_patch(gated(), tmp / "patches" / f"damaged ({fmt})")
        if fmt == 2:
            as_format_2(damaged)
        (damaged / weights).write_bytes(b"\x00" * 16)
        expect_error("adapters", f"{weights} of 16 zero bytes", lambda d=damaged: ht.from_pretrained(d),
                     f"{weights}: not a readable safetensors file")
    expect_error("adapters", "model_class= for a patch repo", lambda: ht.from_pretrained(
        ht.save_patch(gated(), tmp / "patches" / "mc"), model_class=LlamaForCausalLM), "model_class= is not accepted")
    expect_error("adapters", "merge=True for a full folder", lambda: ht.from_pretrained(folder, merge=True),
                 "apply to patch repos")
    expect_error("adapters", "export of a folder that is not a patch repo", lambda: export_full_folder(
        folder, tmp / "exported"), "adapter_config.json")  # the record a patch repo holds now (formats 1-2: hf_tangent_patch.json)

    def failed_save_leaves_the_folder():
        target = tmp / "patches" / "kept"
        ht.save_patch(gated(), target)
        before = {p.name: p.read_bytes() for p in target.iterdir()}
        with contextlib.suppress(ValueError):
            ht.save_patch(unpatched, target)
        return before == {p.name: p.read_bytes() for p in target.iterdir()}

    def round_trip():
        model = gated()
        loaded = ht.from_pretrained(ht.save_patch(model, tmp / "patches" / "rt"))
        return torch.equal(logits(model), logits(loaded)) and ht.get_config(loaded) == ht.get_config(model)

    expect_ok("adapters", "a failed save_patch leaves the existing folder as it was", failed_save_leaves_the_folder)
    expect_ok("adapters", "save_patch -> from_pretrained gives identical logits", round_trip)


def artifacts_cases(tmp: Path, folder: Path):
    """Issue 31: every writer refuses what is not its own (byte-identical after), replaces its own whole
    and atomically; the base is checked by every value and its computation config."""
    import os

    from transformers import LlamaForCausalLM

    from hf_tangent.core import destinations
    from hf_tangent.core.destinations import DestinationError

    def gated(value=0.5, **kwargs):
        model = ht.patch(LlamaForCausalLM.from_pretrained(folder, **kwargs).eval(),
                         ht.TangentConfig(update="projected", gates=True))
        with torch.no_grad():
            ht.tangent_layers(model)[0].gate.fill_(value)
        return model

    def tree(path):
        return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in sorted(Path(path).rglob("*"))}

    def refused_untouched(case, write, target, message):
        before = tree(target) if Path(target).is_dir() else None
        expect_error("artifacts", case, write, message, kinds=(DestinationError,))
        if before is not None and tree(target) != before:
            record("artifacts", case + " (folder changed)", "silent wrong")

    user = tmp / "user"
    (user / "data").mkdir(parents=True)
    (user / "notes.txt").write_text("mine")
    cwd = Path.cwd()
    os.chdir(user)
    try:
        for name, write in (("save_patch", lambda m, f: ht.save_patch(m, f)),
                            ("save_pretrained", lambda m, f: m.save_pretrained(f)),
                            ("save_hub_folder", lambda m, f: ht.save_hub_folder(m, f))):
            refused_untouched(f"{name} over a user's folder", lambda w=write: w(gated(), user), user,
                              "current folder")
            refused_untouched(f"{name} into '.'", lambda w=write: w(gated(), "."), user, "current folder")
            refused_untouched(f"{name} into ''", lambda w=write: w(gated(), ""), user, "empty path")
            refused_untouched(f"{name} into the base's folder", lambda w=write: w(gated(), folder), folder,
                              "which this save reads from")
    finally:
        os.chdir(cwd)
    (tmp / "other").mkdir()
    (tmp / "other" / "x.txt").write_text("x")
    refused_untouched("save_patch over a folder of other files", lambda: ht.save_patch(gated(), tmp / "other"),
                      tmp / "other", "did not write")

    def failure_after_staging():
        target = tmp / "atomic"
        ht.save_patch(gated(2.0), target)
        before, real = tree(target), os.replace

        def flaky(src, dst):
            if ".hf_tangent-ready-" in str(src):  # moving the complete stage in
                raise OSError("injected")
            return real(src, dst)

        destinations.os.replace = flaky
        try:
            ht.save_patch(gated(0.5), target)
        except OSError:
            pass
        finally:
            destinations.os.replace = real
        return tree(target) == before

    def stale_shards_do_not_survive():
        gated(2.0).save_pretrained(tmp / "sharded", max_shard_size="50KB")
        new = gated(0.5)
        new.save_pretrained(tmp / "sharded")
        names = [p.name for p in (tmp / "sharded").iterdir()]
        return "model.safetensors.index.json" not in names and torch.equal(
            logits(ht.from_pretrained(tmp / "sharded")), logits(new))

    def float16_load_accepted():
        return ht.get_config(ht.from_pretrained(ht.save_patch(gated(), tmp / "fp16"), dtype=torch.float16)).gates

    def one_row_refused():
        repo = ht.save_patch(gated(), tmp / "row")
        model = LlamaForCausalLM.from_pretrained(folder)
        with torch.no_grad():
            model.get_input_embeddings().weight[40] += 1e-3
        model.save_pretrained(tmp / "row_base")
        try:
            ht.from_pretrained(repo, base_model=str(tmp / "row_base"))
        except ValueError as err:
            return "the weights differ" in str(err)
        return False

    expect_ok("artifacts", "a failure after staging leaves the old repo byte-identical", failure_after_staging)
    expect_ok("artifacts", "a re-save removes the earlier save's shards and index", stale_shards_do_not_survive)
    expect_ok("artifacts", "a float16 load of the same base is accepted", float16_load_accepted)
    expect_ok("artifacts", "one changed embedding row in the base is refused", one_row_refused)
    issue47_artifact_cases(tmp, folder, gated, tree)
    repo = ht.save_patch(gated(), tmp / "trc")
    expect_error("artifacts", "trust_remote_code=True for a patch repo",
                 lambda: ht.from_pretrained(repo, trust_remote_code=True), "base_trust_remote_code=True")
    expect_error("artifacts", "skip_base_check='yes'", lambda: ht.from_pretrained(repo, skip_base_check="yes"),
                 "skip_base_check= must be True or False")
    expect_error("artifacts", "save_patch card='a string'", lambda: ht.save_patch(gated(), tmp / "c", card="a string"),
                 "card= must be a dict")


def issue47_artifact_cases(tmp: Path, folder: Path, gated, tree):
    """Issue 47: what a killed save leaves is finished or rolled back by the next reader or writer; an
    empty folder is staged; a re-save keeps no file of the earlier save's tokenizer; writers refuse what
    their reader would refuse. And issue 59's run folders: a rerun replaces the files it writes, one run
    at a time, nothing parsed out of a name, no link followed."""
    import subprocess

    from hf_tangent.core.destinations import DestinationError
    from hf_tangent.experiments.runs import LOCK, RunFolder

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)

    def killed_between_renames_finished_by_the_loader():
        root = tmp / "killed"
        new = gated(0.75)
        ht.save_patch(gated(2.0), root / f".p.hf_tangent-old-{dead}-0123abcd")
        ht.save_patch(new, root / "stage")
        (root / "stage").rename(root / f".p.hf_tangent-ready-{dead}-4567cdef")
        return torch.equal(logits(ht.from_pretrained(root / "p")), logits(new)) and [
            p.name for p in root.iterdir()] == ["p"]

    def users_folders_named_like_leftovers_untouched():
        root = tmp / "legacy"
        users = (".p.old-20240115", ".p.staging-12345678", ".q.old-89abcdef")  # 0.3's names, or a user's
        for name in users:
            (root / name).mkdir(parents=True)
            (root / name / "notes.txt").write_text(name)
        ht.save_patch(gated(0.25), root / "p")
        loaded = ht.from_pretrained(root / "p")
        try:
            ht.from_pretrained(root / "q")  # missing: refused, and .q.old-* not moved in
        except ValueError:
            pass
        return sorted(p.name for p in root.iterdir()) == sorted([*users, "p"]) and all(
            (root / n / "notes.txt").read_text() == n for n in users) and torch.equal(logits(loaded), logits(gated(0.25)))

    def empty_folder_staged():
        from faults import Steps

        (tmp / "empty").mkdir()
        with Steps() as steps:
            ht.save_patch(gated(), tmp / "empty")
        return not [s for s in steps.log if s.startswith("open(") and f"{tmp / 'empty'}/" in s]

    def tokenizer_of_the_earlier_save_gone():
        from transformers import AutoTokenizer

        target = tmp / "hub47"
        other = AutoTokenizer.from_pretrained(folder)
        other.add_special_tokens({"additional_special_tokens": ["<x>"]})
        ht.save_hub_folder(gated(), target, tokenizer=other)
        (target / "vocab.json").write_text("{}")
        tokenizer = AutoTokenizer.from_pretrained(folder)
        ht.save_hub_folder(gated(), target, tokenizer=tokenizer)
        loaded = AutoTokenizer.from_pretrained(target)
        gated().save_pretrained(target)
        return (not (target / "vocab.json").exists() and len(loaded) == len(tokenizer)
                and not (target / "tokenizer.json").exists())

    def rerun_replaces_its_files_and_leaves_the_rest():
        run = tmp / "run47"
        with RunFolder(run):
            (run / "model").mkdir(parents=True)
            (run / "model" / "config.json").write_text("{}")
            (run / "checkpoint-2").mkdir()
            _eval_report().save(run)
        kept = {k: v for k, v in tree(run).items() if not k.startswith("report.")}
        report = _eval_report()
        report.data["seconds"] = 9.5
        report.save(run)
        return ({k: v for k, v in tree(run).items() if not k.startswith("report.")} == kept
                and json.loads((run / "report.json").read_text())["seconds"] == 9.5)

    def failed_write_leaves_the_earlier_report():
        from faults import Steps, count_steps

        run = tmp / "run47b"
        _eval_report().save(run)
        before = tree(run)
        bad = _eval_report()
        bad.data["seconds"] = 9.5
        steps = count_steps(lambda: bad.save(tmp / "run47count"))
        try:
            with Steps(fail=len(steps)):  # report.json's temporary file written, its rename (the last step) fails
                bad.save(run)
        except OSError:
            pass
        return tree(run)["report.json"] == before["report.json"] and [
            p.name for p in run.iterdir() if p.name.startswith(".")] == [LOCK]

    expect_ok("artifacts", "a save killed between its renames is finished by the next loader (logged)",
              killed_between_renames_finished_by_the_loader)
    expect_ok("artifacts", "a user's .NAME.old-20240115 / .NAME.staging-12345678 is never touched by a save or a load",
              users_folders_named_like_leftovers_untouched)

    def staged_write_reads_no_process_id():  # issue 59: a 20-digit id in a stage's name raised OverflowError
        root = tmp / "pid59"
        (root / f".p.hf_tangent-staging-{10**20}-0123abcd").mkdir(parents=True)
        (root / ".p.hf_tangent-ready-99999999999999999999999-4567cdef").mkdir()
        ht.save_patch(gated(0.5), root / "p")
        return [p.name for p in root.iterdir()] == ["p"]

    def held_and_linked_stages_left_alone():  # a live writer's stage (its flock held) and a link are not ours to take
        root = tmp / "held59s"
        held = root / ".p.hf_tangent-staging-89abcdef"
        held.mkdir(parents=True)
        (root / "elsewhere").mkdir()
        (root / ".p.hf_tangent-old-0123abcd").symlink_to(root / "elsewhere")
        holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], "
                                   "os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); print(1, flush=True); time.sleep(60)",
                                   str(held)], stdout=subprocess.PIPE, text=True)
        try:
            holder.stdout.readline()
            ht.save_patch(gated(0.5), root / "p")
            return sorted(p.name for p in root.iterdir()) == sorted(
                [held.name, ".p.hf_tangent-old-0123abcd", "elsewhere", "p"])
        finally:
            holder.kill()
            holder.wait()

    expect_ok("artifacts", "stages named with a 20-digit process id (earlier saves): removed, nothing parsed",
              staged_write_reads_no_process_id)
    expect_ok("artifacts", "a stage a live writer holds, and a link named like a stage: left as they are",
              held_and_linked_stages_left_alone)
    inside = ht.save_patch(gated(), tmp / "src47")
    from hf_tangent.artifacts.patch_repo import export_full_folder

    expect_error("artifacts", "export of a patch repo into a folder inside it", lambda: export_full_folder(
        inside, inside / "sub"), "is inside", kinds=(DestinationError,))
    expect_error("artifacts", "save_patch into a folder inside the base's folder", lambda: ht.save_patch(
        gated(), folder / "patch47"), "is inside", kinds=(DestinationError,))
    expect_ok("artifacts", "a save into an existing empty folder is staged (nothing written inside it in place)",
              empty_folder_staged)
    expect_ok("artifacts", "a re-save with another tokenizer, then without one, keeps none of the earlier tokenizer",
              tokenizer_of_the_earlier_save_gone)
    expect_ok("artifacts", "a rerun into a run folder replaces its report and leaves checkpoints and model/",
              rerun_replaces_its_files_and_leaves_the_rest)
    expect_ok("artifacts", "a report save that fails midway leaves the earlier report.json and no temporary file",
              failed_write_leaves_the_earlier_report)
    for case, kwargs, message in [("save_patch(base_model=123)", dict(base_model=123), "base_model=123; accepted"),
                                  ("save_patch(base_model='')", dict(base_model=""), "base_model=''; accepted"),
                                  ("save_patch(revision=5)", dict(revision=5), "revision=5; accepted")]:
        expect_error("artifacts", case, lambda k=kwargs: ht.save_patch(gated(), tmp / "p47", **k), message)
    (tmp / "user47").mkdir()
    (tmp / "user47" / "thesis.tex").write_text("x")
    expect_ok("artifacts", "Report.save into a folder of the user's files: written beside them, which stay",
              lambda: _eval_report().save(tmp / "user47") and (tmp / "user47" / "thesis.tex").read_text() == "x")
    # a folder of the user's files that merely have a run's names: written beside, never touched; an input inside
    # the output folder; what the hidden probe of issue 59 planted
    named = tmp / "named47"
    (named / "model").mkdir(parents=True)
    (named / "model" / "my_weights.txt").write_text("mine")
    (named / "README.md").write_text("# notes")
    expect_ok("artifacts", "Report.save beside the user's model/ and README.md leaves them byte-identical",
              lambda: _eval_report().save(named) and {k: v for k, v in tree(named).items() if not k.startswith(
                  ("report.", LOCK))} == {"README.md": b"# notes", "model": None, "model/my_weights.txt": b"mine"})
    from hf_tangent import cli

    with RunFolder(tmp / "run47c"):
        ht.save_patch(gated(), tmp / "run47c" / "patch")
    kept = tree(tmp / "run47c")
    expect_ok("artifacts", "eval --model inside its --output-dir: refused naming both, the folder as it was",
              lambda: cli.main(["eval", "--model", str(tmp / "run47c" / "patch"), "--output-dir", str(tmp / "run47c"),
                                "--max-windows", "1", "--seq-len", "16"]) == 2 and tree(tmp / "run47c") == kept)
    expect_error("artifacts", "RunFolder(inputs=) with an input inside the folder",
                 lambda: RunFolder(tmp / "run47c", inputs={"model=": str(tmp / "run47c" / "patch")}).__enter__(),
                 "lies inside the output folder", kinds=(DestinationError,))
    phase = tmp / "phase59" / ".hf_tangent-run-earlier-99999999999999999999-deadbeef"
    phase.mkdir(parents=True)
    expect_ok("artifacts", "an earlier release's hidden phase folder with a 20-digit pid: an entry like any other",
              lambda: _eval_report().save(phase.parent) and phase.is_dir())
    (tmp / "mark59").mkdir()
    (tmp / "mark59" / ".hf_tangent-run.json").write_text('{"pid": Infinity, "host": "x"}')
    expect_ok("artifacts", "an earlier release's mark with a forged pid is never read",
              lambda: _eval_report().save(tmp / "mark59") and (tmp / "mark59" / "report.json").is_file())
    (tmp / "link59").mkdir()
    (tmp / "link59" / "patch").symlink_to(named)
    expect_error("artifacts", "a symbolic link under a run's entry name: refused, never followed",
                 lambda: _eval_report().save(tmp / "link59"), "holds symbolic links (patch) where a run writes", kinds=(DestinationError,))
    errors = []
    with RunFolder(tmp / "held59"):
        second = threading.Thread(target=lambda: errors.append(_refusal(lambda: _eval_report().save(tmp / "held59"))))
        second.start()
        second.join()
    expect_ok("artifacts", "a second run into a folder another run holds (another thread) is refused by message",
              lambda: errors == ["is in use by another hf_tangent run"] and not (tmp / "held59" / "report.json").exists())


def _refusal(fn) -> str | None:
    """The part of the DestinationError `fn` raises that says a run folder is in use, else None."""
    from hf_tangent.core.destinations import DestinationError

    try:
        fn()
    except DestinationError as err:
        return "is in use by another hf_tangent run" if "is in use by another hf_tangent run" in str(err) else str(err)
    return None


def _eval_report():
    from hf_tangent.experiments.report import Report

    return Report("eval", {"command": "eval", "model": "m", "text": "t", "seq_len": 8, "windows": 1,
                           "tokens_per_variant": 1, "seconds": 0.1, "unpatched_is": "the model", "device": "cpu",
                           "dtype": "float32", "seed": 0, "threads": 1, "torch": "x", "hf_tangent_version": "x",
                           "python": "x", "peak_rss_gb": 0.1,
                           "rows": [{"variant": "unpatched", "nll": 1.0, "perplexity": 2.7, "delta_nll": 0.0,
                                     "delta_perplexity": 0.0, "tokens": 1, "config": None}]})


def lm_eval_cases(tmp: Path, folder: Path):
    """ht.lm_eval: every option refused before a model is loaded; a patched model is scored and given back as it was."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return expect_error("lm_eval", "without lm-eval installed", lambda: ht.lm_eval(str(folder)), "pip install")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    small = dict(tasks=["austen_lastword"], variants=["unpatched"], limit=2, bootstrap=10)
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    for case, kwargs, message in [
            ("variants=['tangent']", dict(variants=["tangent"]), "variants=['tangent'] has 'tangent', not one of the choices; accepted:"),
            ("tasks=['no_such_task']", dict(tasks=["no_such_task"]), "unknown lm-eval tasks ['no_such_task']"),
            ("a shipped task and an unknown one (lm-eval's own tasks indexed for it)",
             dict(tasks=["austen_lastword", "no_such_task"]), "unknown lm-eval tasks ['no_such_task']"),
            ("limit=0", dict(limit=0), "limit=0 is out of range"),
            ("num_fewshot=-1", dict(num_fewshot=-1), "num_fewshot=-1 is out of range"),
            ("batch_size=0", dict(batch_size=0), "batch_size=0 is out of range"),
            ("bootstrap=0", dict(bootstrap=0), "bootstrap=0 is out of range"),
            ("include_path of a missing folder", dict(include_path=str(tmp / "missing")), "is not a folder; accepted"),
            ("backend='tgi'", dict(backend="tgi"), "backend='tgi' is not one of the choices; accepted: one of 'hf', 'vllm'"),
            ("backend=None", dict(backend=None), "backend=None has the wrong type (NoneType); accepted: one of 'hf', 'vllm'"),
            ("vllm_args with backend='hf'", dict(vllm_args={"enforce_eager": True}), "vllm_args are for backend='vllm'"),
            ("vllm_args a list", dict(backend="vllm", vllm_args=["enforce_eager"]), "has the wrong type (list); accepted: a mapping"),
            ("vllm_args with a non-string key", dict(backend="vllm", vllm_args={1: 2}), "a dict of vllm.LLM keyword"),
            ("vllm_args setting the dtype lm_eval sets", dict(backend="vllm", vllm_args={"dtype": "float16"}),
             "vllm_args ['dtype'] are set by lm_eval itself")]:
        expect_error("lm_eval", case, lambda k=kwargs: ht.lm_eval(model, tokenizer=tokenizer, **(small | k)), message, model,
                     kinds=(ValueError, TypeError, FileNotFoundError))
    expect_error("lm_eval", "a model folder that does not exist", lambda: ht.lm_eval(
        model, tokenizer=tokenizer, model_folders=[str(tmp / "missing")], **small), "missing", model,
        kinds=(ValueError, OSError))

    def patched_model_scored_as_given():
        m = ht.patch(LlamaForCausalLM.from_pretrained(folder).eval(), ht.TangentConfig(update="projected", gates=True))
        before = fingerprint(m)
        report = ht.lm_eval(m, tokenizer=tokenizer, **small)
        return same(before, fingerprint(m)) and report.data["variants"] == ["as given", "unpatched"]

    expect_ok("lm_eval", "a patched model is scored as given and comes back unchanged", patched_model_scored_as_given)

    # merge_lm_eval / hf-tangent lm-eval-merge: parts of one measurement or a refusal naming why
    import copy

    from hf_tangent.experiments.report import Report

    part = ht.lm_eval(model, tokenizer=tokenizer, **small)
    more = ht.lm_eval(model, tokenizer=tokenizer, **(small | dict(limit=3)))
    tampered = copy.deepcopy(part.data)
    nan = copy.deepcopy(part.data)
    nan["results"]["unpatched"]["austen_lastword"]["acc,none"] = float("nan")
    tampered["results"]["unpatched"]["austen_lastword"]["acc,none"] += 0.25  # the same items, another score
    tampered["seconds"] += 1.0  # another process
    for case, reports, message in [
            ("merge_lm_eval([])", [], "0 report(s) given"),
            ("merge_lm_eval(one report)", [part], "1 report(s) given"),
            ("merge_lm_eval('a path', not a list)", str(tmp), "expects a list of lm-eval reports"),
            ("merge_lm_eval([report, None])", [part, None], "neither a Report nor the path"),
            ("merge_lm_eval with a missing report.json", [part, str(tmp / "missing.json")], "not a readable report.json"),
            ("merge_lm_eval of limit 2 and limit 3 of one task", [part, more], "scored with limit 2 in one part and 3"),
            ("merge_lm_eval with NaN for an accuracy", [part, Report("lm-eval", nan)],
             "holds nan (float); accepted: a finite number"),
            ("merge_lm_eval with another score for the same variant on the same items",
             [part, Report("lm-eval", tampered)], "differs between the parts"),
            ("merge_lm_eval of another model", [part, Report("lm-eval", {**part.data, "model": "other"})],
             "the parts differ in 'model'")]:
        expect_error("lm_eval", case, lambda r=reports: ht.merge_lm_eval(r), message)
    other_weights = copy.deepcopy(more.data)
    other_weights["weights"]["digest"] = "0" * 64
    other_software = copy.deepcopy(more.data)
    other_software["versions"]["lm_eval"] = "0.0.1"
    no_digest = {k: v for k, v in more.data.items() if k != "weights"}
    from hf_tangent.artifacts.identity import scored_weights

    other_patch = copy.deepcopy(more.data)  # the same base patched with another rule
    other_patch["weights"] = scored_weights(ht.patch(LlamaForCausalLM.from_pretrained(folder), ht.TangentConfig()))
    int_digest = copy.deepcopy(more.data)
    int_digest["weights"]["digest"] = 5
    for case, data, message in [("merge_lm_eval of parts scored on other weights", other_weights,
                                 "the parts scored different weights"),
                                ("merge_lm_eval of parts run with another lm-eval", other_software,
                                 "the parts ran other software: lm_eval"),
                                ("merge_lm_eval of a part that records no weights digest", no_digest, "records no weights"),
                                ("merge_lm_eval of the same base unpatched and patched", other_patch,
                                 "the patch differs: patch 'none' in part 1"),
                                ("merge_lm_eval of a part whose weights digest is 5", int_digest,
                                 "weights.digest is 5, not 64 hex digits")]:
        expect_error("lm_eval", case, lambda d=data: ht.merge_lm_eval([part, Report("lm-eval", d)]), message)
    expect_error("lm_eval", "merge_lm_eval of a report with itself (a part twice)", lambda: ht.merge_lm_eval([part, part]),
                 "repeats a part already given")
    expect_error("lm_eval", "merge_lm_eval of a transformers part and a vLLM part",
                 lambda: ht.merge_lm_eval([part, Report("lm-eval", {**more.data, "backend": "vllm"})]),
                 "the parts differ in 'backend'")
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        expect_error("lm_eval", "backend='vllm' without vLLM installed", lambda: ht.lm_eval(
            model, tokenizer=tokenizer, backend="vllm", **small), "needs vLLM, which is not installed", model,
            kinds=(RuntimeError,))


def options_cases(tmp: Path):
    """Every option of every public recipe function and options dataclass, through the API, the
    dataclasses, the command line and recipe files, probed with 0, -1, NaN, +-inf and a wrong type
    (tests/sweeps/option_walk.py: generated by introspection, so a new option is covered unedited)."""
    import option_walk

    (tmp / "options").mkdir(exist_ok=True)
    for case in option_walk.cases(tmp / "options"):
        outcome, detail = case.run()
        record("options", case.name, outcome, detail)


def entries_cases(tmp: Path, folder: Path):
    """Issue 32's examples that are not one number: wrong types, and checks made before any work."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from hf_tangent.experiments.report import Report

    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = ht.TextSource(text_files=(str(AUSTEN / "emma.txt"),), calibration_files=(str(AUSTEN / "prideprejudice.txt"),))
    small = dict(tokenizer=tokenizer, text=text, seq_len=16, max_windows=1)
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    for name in ("ablate", "layer_sensitivity", "evaluate_rules", "diagnose_layers"):
        for value in (0, -1, -2):
            expect_error("entries", f"{name}(batch_size={value})", lambda n=name, v=value: getattr(ht, n)(
                model, **small, batch_size=v, progress=False), f"batch_size={value} is out of range; accepted: an integer >= 1",
                model)
    for kwargs, message in [(dict(train_windows=0), "train_windows=0 is out of range"),
                            (dict(eval_batch_size=0), "eval_batch_size=0 is out of range"),
                            (dict(training_args="fast"), "training_args='fast' has the wrong type (str); accepted: a "
                                                         "TangentTrainingArguments, or None")]:
        expect_error("entries", f"calibrate_gates({kwargs})", lambda k=kwargs: ht.calibrate_gates(model, **small, **k),
                     message, model)
    expect_error("entries", "finetune(eval_batch_size=0)", lambda: ht.finetune(model, **small, eval_batch_size=0),
                 "eval_batch_size=0 is out of range", model)
    unnamed = LlamaForCausalLM(LlamaConfig.from_pretrained(folder)).eval()  # built from a config: no name recorded
    args = ht.TangentTrainingArguments(output_dir=str(tmp / "entries-cal"), max_steps=1, use_cpu=True,
                                       per_device_train_batch_size=1)
    expect_error("entries", "calibrate_gates(save_patch=) on a model without a name",
                 lambda: ht.calibrate_gates(unnamed, **small, train_windows=1, training_args=args,
                                            save_patch=str(tmp / "entries-patch")),
                 "config._name_or_path is empty", unnamed)
    (tmp / "list.json").write_text("[1, 2]")
    (tmp / "eval.json").write_text('{"command": "eval"}')
    expect_error("entries", "Report.load of a JSON list", lambda: Report.load(tmp / "list.json"),
                 "not an hf-tangent report: a JSON list")
    expect_error("entries", "Report.load of {'command': 'eval'}", lambda: Report.load(tmp / "eval.json"),
                 "an incomplete 'eval' report: field")
    expect_error("entries", "Report.load of a dict", lambda: Report.load({"command": "eval"}),
                 "expects the path of a report.json")
    for field, value, message in [("weights", {"digest": 5}, "weights.digest is 5, not 64 hex digits"),
                                  ("versions", ["torch"], "versions is ['torch'], not an object"),
                                  ("task_files", {"t": 7}, "task_files['t'] is 7, not 64 hex digits")]:
        (tmp / "prov.json").write_text(json.dumps({**_eval_report().data, field: value}))
        expect_error("entries", f"Report.load of a report whose {field} is {value!r}",
                     lambda: Report.load(tmp / "prov.json"), message)
    expect_error("entries", "TangentLayer('not a config', ...)", lambda: ht.TangentLayer(
        "not a config", 0, update=True, parallel=False), "accepted: a TangentConfig")
    small_vocab = tmp / "small_vocab"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(small_vocab)
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return
    scored = []
    from hf_tangent.experiments import downstream

    original = downstream.evaluate
    downstream.evaluate = lambda *a, **k: scored.append(1) or original(*a, **k)
    try:
        expect_error("entries", "lm_eval with a model folder whose vocabulary is smaller than the tokenizer's",
                     lambda: ht.lm_eval(model, tokenizer=tokenizer, tasks=["austen_lastword"], variants=["unpatched"],
                                        limit=2, model_folders=[str(small_vocab)]),
                     "has a vocabulary of 64 tokens and the tokenizer", model)
    finally:
        downstream.evaluate = original
    expect_ok("entries", "... refused before any variant was scored", lambda: not scored)


def tiny_model_folder(tmp: Path) -> Path:
    """A random tiny Llama with the real SmolLM2 tokenizer, saved as a plain transformers folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_tangent.artifacts.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=64)).save_pretrained(tmp / "tiny")
    tokenizer.save_pretrained(tmp / "tiny")
    return tmp / "tiny"


def batch_cases(tmp: Path):
    """Each row's result does not depend on the rows beside it (a sequence alone or in a batch, a decode step of
    one or of many), hostile rows and layouts included; the setting of earlier releases is not read."""
    import os

    from hf_tangent.core.fused import fused_residual_delta
    from hf_tangent.core.rules import residual_delta

    def rows_alone(fn, x, y, **kw):
        return torch.cat([fn(x[i:i + 1], y[i:i + 1], **kw) for i in range(x.shape[0])])

    x, y = torch.randn(70, 48) * 3, torch.randn(70, 48)
    for name, fn in (("fused", fused_residual_delta), ("reference", residual_delta)):
        for label, edit in (("a NaN row", lambda a, b: a[5].fill_(float("nan"))),
                            ("an inf in one row", lambda a, b: b[17].__setitem__(3, float("inf"))),
                            ("a zero row", lambda a, b: a[16].zero_()),
                            ("a row of 1e30", lambda a, b: a[64].fill_(1e30))):
            a, b = x.clone(), y.clone()
            edit(a, b)
            expect_ok("batch", f"{name}, retract, {label} among 70: every row as computed alone",
                      lambda a=a, b=b, fn=fn: torch.equal(fn(a, b, "retract").nan_to_num(7.0),
                                                          rows_alone(fn, a, b, update="retract").nan_to_num(7.0)))
        for label, (a, b) in (("transposed storage", (x.t().contiguous().t(), y.t().contiguous().t())),
                              ("every other row of a larger tensor", (torch.cat([x, x])[::2], torch.cat([y, y])[::2])),
                              ("one row expanded to 70", (x[:1].expand(70, 48), y[:1].expand(70, 48))),
                              ("bfloat16, transposed storage", (x.bfloat16().t().contiguous().t(), y.bfloat16().t().contiguous().t()))):
            expect_ok("batch", f"{name}, norm_preserving, {label}: every row as computed alone",
                      lambda a=a, b=b, fn=fn: torch.equal(fn(a, b, "norm_preserving"),
                                                          rows_alone(fn, a.contiguous(), b.contiguous(), update="norm_preserving")))
    for gate, name in ((torch.tensor([float("nan")]), "a NaN gate"), (torch.tensor([0.5], dtype=torch.bfloat16), "a bf16 gate"),
                       (torch.tensor([-2.0]), "a negative gate"), (torch.tensor([0.0]), "a zero gate")):
        def agree(g=gate):
            out, ref = fused_residual_delta(x, y, "retract", gate=g), residual_delta(x, y, "retract", gate=g)
            alone = rows_alone(fused_residual_delta, x, y, update="retract", gate=g)
            return (torch.equal(out.isnan(), ref.isnan()) and torch.allclose(out.nan_to_num(), ref.nan_to_num(), atol=1e-5)
                    and torch.equal(out.nan_to_num(7.0), alone.nan_to_num(7.0)))
        expect_ok("batch", f"{name}: as the reference rule, every row as computed alone", agree)

    def generate(model, ids):
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=8, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, pad_token_id=0)

    def gated_lambda(implementation):
        torch.manual_seed(0)
        model = patched_tiny(implementation=implementation)
        ht.set_homotopy(model, {0: 0.3, 1: 0.8, 2: 1.0})
        return model.eval()

    prompts = torch.randint(0, VOCAB, (9, 6), generator=torch.Generator().manual_seed(1))

    def layers_alone_and_in_batch(implementation):
        """In generate (prefill, then one row per sequence), every patched layer's update for the batch of 9
        against the same layer on each row alone (the base model's own matmuls are not batch-invariant here)."""
        model, seen = gated_lambda(implementation), []
        handles = [layer.register_forward_hook(lambda m, a, out: seen.append((m, a[0], a[1], out)))
                   for layer in ht.tangent_layers(model)]
        try:
            generate(model, prompts)
        finally:
            for handle in handles:
                handle.remove()
        with torch.no_grad():
            return bool(seen) and all(torch.equal(out.reshape(-1, out.shape[-1]), torch.cat(
                [m(a[i:i + 1], b[i:i + 1]) for a, b in [(x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1]))]
                 for i in range(a.shape[0])])) for m, x, y, out in seen)

    for implementation in ("fused", "reference"):
        expect_ok("batch", f"{implementation}, gated, per-layer lambda: in generate, every layer's update for a batch of "
                  "9 is each row's alone, bit for bit", lambda i=implementation: layers_alone_and_in_batch(i))

    def fused_as_reference():
        a, b = generate(gated_lambda("fused"), prompts[:2]), generate(gated_lambda("reference"), prompts[:2])
        return torch.equal(a.sequences, b.sequences) and all(
            torch.allclose(u, v, rtol=1e-5, atol=1e-5) for u, v in zip(a.logits, b.logits, strict=True))

    expect_ok("batch", "gated, per-layer lambda: generate as implementation='reference'", fused_as_reference)

    def disabled_is_the_base():
        torch.manual_seed(0)
        base = make_tiny("llama").eval()
        model = ht.patch(copy.deepcopy(base), ht.TangentConfig(update="retract")).eval()
        with ht.disabled(model):
            inside = generate(model, IDS[:1, :6])
        return torch.equal(inside.sequences, generate(base, IDS[:1, :6]).sequences)

    expect_ok("batch", "inside ht.disabled: generate as the unpatched model", disabled_is_the_base)
    with torch.no_grad():
        plain, one_row = gated_lambda("fused")(IDS).logits, fused_residual_delta(x[:1], y[:1], "retract")
    for value in ("1", "0", "yes", ""):  # HF_TANGENT_CPU_KERNEL of releases up to 0.3: no longer read, nothing compiled
        def not_read(value=value):
            saved = {k: os.environ.get(k) for k in ("HF_TANGENT_CPU_KERNEL", "HF_TANGENT_CACHE")}
            os.environ.update(HF_TANGENT_CPU_KERNEL=value, HF_TANGENT_CACHE=str(tmp / "cache-of-the-kernel"))
            try:
                with torch.no_grad():  # a forward, and one row (where the kernel took over)
                    same = (torch.equal(gated_lambda("fused")(IDS).logits, plain)
                            and torch.equal(fused_residual_delta(x[:1], y[:1], "retract"), one_row))
            finally:
                for k, v in saved.items():
                    os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
            return same and not (tmp / "cache-of-the-kernel").exists()
        expect_ok("batch", f"HF_TANGENT_CPU_KERNEL={value!r} (an earlier release's setting): not read, the same "
                  "logits, nothing compiled or cached", not_read)


def remote_code_cases(tmp: Path):
    """Issue 45: hf_tangent's API on a model loaded through a saved folder's remote code (its patch is the
    folder's copy of the core): each function works as on an ht.patch'ed model, or refuses by name, leaving
    the model as it was."""
    from transformers import AutoModelForCausalLM

    folder = tmp / "remote_code_folder"
    if not folder.exists():
        ht.save_hub_folder(patched_tiny(), folder)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    plain = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    ht.unpatch(plain)
    expect_ok("remote_code", "the layers are found", lambda: [c.index for c in ht.tangent_layers(model)] == [0, 1, 2])
    expect_ok("remote_code", "get_config is a read-only TangentConfig",
              lambda: isinstance(ht.get_config(model), ht.TangentConfig) and ht.get_config(model).is_frozen)
    for value, message in [(1.5, "accepted: a number >= 0 and <= 1 or a mapping."), (float("nan"), "accepted: a number >= 0 and <= 1 or a mapping."),
                           ({0: 0.5}, "accepted: exactly the patched layers")]:
        expect_error("remote_code", f"set_homotopy {value!r}", lambda v=value: ht.set_homotopy(model, v), message, model)
    expect_error("remote_code", "update_config beta=2", lambda: ht.update_config(model, update="soft", beta=2.0),
                 "TangentConfig.beta", model)
    expect_error("remote_code", "update_config unknown field", lambda: ht.update_config(model, betta=0.5),
                 "unknown TangentConfig fields", model)
    expect_error("remote_code", "patch with a string", lambda: ht.patch(model, "projected"), "expects a TangentConfig",
                 model)
    expect_error("remote_code", "save_patch without base_model", lambda: ht.save_patch(model, tmp / "remote_repo"),
                 "pass base_model=", model)
    expect_ok("remote_code", "save_patch refused: nothing written", lambda: not (tmp / "remote_repo").exists())
    before = fingerprint(model)
    with ht.disabled(model):
        expect_ok("remote_code", "disabled: the unpatched model", lambda: torch.equal(logits(model), logits(plain)))
        expect_error("remote_code", "unpatch inside disabled", lambda: ht.unpatch(model), "inside `with hf_tangent.disabled")
    record("remote_code", "disabled: the same patch after the block", "ok" if same(before, fingerprint(model)) else "half-patched")

    def unpatched_is_plain():
        m = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        ht.unpatch(m)
        return ht.get_config(m) is None and not ht.tangent_layers(m) and torch.equal(logits(m), logits(plain))

    expect_ok("remote_code", "unpatch: the unpatched model", unpatched_is_plain)


# group -> its cases (a function of a scratch folder and the tiny model folder)
GROUPS = {
    "config": lambda tmp, folder: config_cases(),
    "numbers": lambda tmp, folder: number_cases(tmp),
    "patch": lambda tmp, folder: patch_cases(),
    "behaviour": lambda tmp, folder: behaviour_cases(),
    "reload": lambda tmp, folder: reload_cases(tmp),
    "cli": lambda tmp, folder: cli_cases(tmp, folder),
    "homotopy": lambda tmp, folder: homotopy_cases(),
    "disabled": lambda tmp, folder: disabled_cases(),
    "update_config": lambda tmp, folder: update_config_cases(),
    "register": lambda tmp, folder: register_cases(),
    "describe": lambda tmp, folder: describe_cases(),
    "analysis": analysis_cases,
    "heal": heal_cases,
    "adapters": adapters_cases,
    "artifacts": artifacts_cases,
    "lm_eval": lm_eval_cases,
    "options": lambda tmp, folder: options_cases(tmp),
    "entries": entries_cases,
    "batch": lambda tmp, folder: batch_cases(tmp),
    "remote_code": lambda tmp, folder: remote_code_cases(tmp),
}
OUTCOMES = ["ok", "clear", "unclear", "silent wrong", "crash", "half-patched"]
PASSING = ("ok", "clear")


def run_group(name: str, tmp: Path, folder: Path) -> list[tuple[str, str, str, str]]:
    """The (group, case, outcome, detail) rows of one group, each case run in this process."""
    start = len(RESULTS)
    torch.manual_seed(0)
    GROUPS[name](tmp, folder)
    return RESULTS[start:]


def run_all() -> list[tuple[str, str, str, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder = tiny_model_folder(tmp)
        return [row for name in GROUPS for row in run_group(name, tmp, folder)]


def summary(rows) -> dict:
    """What the kept report (docs/results/hostile_sweep.json) holds: counts per group and outcome."""
    groups = sorted({g for g, *_ in rows})
    return {"report": "hostile_sweep", "cases": len(rows),
            "outcomes": {o: sum(1 for r in rows if r[2] == o) for o in OUTCOMES},
            "groups": {g: {o: sum(1 for r in rows if r[0] == g and r[2] == o) for o in OUTCOMES} for g in groups},
            "failing": [list(r) for r in rows if r[2] not in PASSING]}


def to_markdown(report: dict) -> str:
    lines = ["# Hostile-input sweep", "", f"{report['cases']} cases (`python tests/sweeps/hostile_inputs.py`).", "",
             "| group | " + " | ".join(OUTCOMES) + " |", "|---|" + "---:|" * len(OUTCOMES)]
    for group, counts in report["groups"].items():
        lines.append(f"| {group} | " + " | ".join(str(counts[o]) for o in OUTCOMES) + " |")
    lines.append("| **all** | " + " | ".join(f"**{report['outcomes'][o]}**" for o in OUTCOMES) + " |")
    if report["failing"]:
        lines += ["", "Cases that are not ok / clear:", ""] + [f"- {g} / {c}: **{o}** {d}" for g, c, o, d in report["failing"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", help="write the report here: OUTPUT.json and OUTPUT.md (e.g. docs/results/hostile_sweep)")
    args = parser.parse_args()
    report = summary(run_all())
    text = to_markdown(report)
    print(text)
    if args.output:
        Path(f"{args.output}.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        Path(f"{args.output}.md").write_text(text, encoding="utf-8")
    sys.exit(1 if report["failing"] else 0)


if __name__ == "__main__":
    main()
