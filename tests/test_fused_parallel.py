"""Fused parallel execution (core/fused_parallel.py): the work a converted layer saves (aten ops and Python calls,
counted), one graph under torch.compile, weights that cannot go stale, exact undo, refusals. The reference is
the hook conversion (the model's own code with the FFN fed the block input) given the same weights."""

import collections
import copy
import io
import json
import sys
import threading
import types

import pytest
import torch
from conftest import _llama_kwargs, make_tiny
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

import hf_tangent as ht
from hf_tangent.core.fused_parallel import FusedProjection

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")


def tiny(arch="llama", **overrides):
    if arch == "qwen2":  # biased q, k, v; unbiased gate, up
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**_llama_kwargs())).eval()
    else:
        model = make_tiny(arch, **overrides)
    with torch.no_grad():  # norm gains and biases away from 1 and 0, so that mixing them up shows
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


def convert(model, execution, layers=(0, 2), **fields):
    return ht.patch(model, ht.TangentConfig(parallel_layers=list(layers), parallel_execution=execution, **fields))


def pair(arch="llama", **fields):
    base = tiny(arch)
    return convert(copy.deepcopy(base), "hooks", **fields), convert(base, "fused", **fields)


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def executions(model):
    return [child.fused_execution for child in ht.tangent_layers(model) if child.parallel]


class AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def layer_ops(model, ids, index=0):
    """The aten ops of one call of decoder layer `index`, with the arguments the model gives it."""
    layer, seen = model.model.layers[index], {}
    handle = layer.register_forward_pre_hook(lambda m, a, kw: seen.setdefault("call", (a, kw)), with_kwargs=True)
    logits(model, ids)
    handle.remove()
    args, kwargs = seen["call"]
    with torch.no_grad(), AtenOps() as counter:
        layer(*args, **kwargs)
    return counter.ops


def test_a_converted_layer_runs_fewer_aten_ops_than_an_unpatched_one(ids):
    """The hook conversion runs exactly the unpatched layer's ops; the fused one drops the FFN norm's RMS
    (pow, mean, add, rsqrt, mul) and three of the five projection GEMMs (t, view, mm, _unsafe_view each) and
    adds one slice per projection: 12 ops fewer."""
    base = tiny()
    unpatched = layer_ops(base, ids)
    assert layer_ops(convert(copy.deepcopy(base), "hooks"), ids) == unpatched
    fused = layer_ops(convert(copy.deepcopy(base), "fused"), ids)
    assert fused - unpatched == {"aten.slice.Tensor": 5}
    assert unpatched - fused == {"aten.t.default": 3, "aten.view.default": 3, "aten.mm.default": 3,
                                 "aten._unsafe_view.default": 3, "aten.pow.Tensor_Scalar": 1, "aten.mean.dim": 1,
                                 "aten.add.Tensor": 1, "aten.rsqrt.default": 1, "aten.mul.Tensor": 1}
    assert sum(fused.values()) == sum(unpatched.values()) - 12


def python_calls_per_decode_step(model, ids):
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        token = model(ids[:1], past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        model(token, past_key_values=cache, use_cache=True)
        calls = [0]

        def count(frame, event, arg):
            calls[0] += event == "call"

        sys.setprofile(count)
        try:
            model(token, past_key_values=cache, use_cache=True)
        finally:
            sys.setprofile(None)
    return calls[0]


def test_fused_execution_makes_fewer_python_calls_than_the_hook_conversion(ids):
    """Per converted layer and decode step, against the same hooks: the five projections' forwards no longer
    read weight and bias through Module.__getattr__ (10 calls), nor the two norms their weight (2); each norm
    asks torch.compiler.is_dynamo_compiling once (2): 10 calls fewer."""
    base = tiny()
    hooks = python_calls_per_decode_step(convert(copy.deepcopy(base), "hooks", layers=(0, 1, 2)), ids)
    fused = python_calls_per_decode_step(convert(base, "fused", layers=(0, 1, 2)), ids)
    assert hooks - fused == 3 * 10


def test_compiled_forward_after_an_eager_call_is_one_graph(ids):
    model = convert(tiny(), "fused", update="projected")
    expected = logits(model, ids)  # the eager call
    torch._dynamo.reset()
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(ids)
        assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
        torch.testing.assert_close(torch.compile(model, fullgraph=True)(ids).logits, expected, rtol=1e-5, atol=1e-5)


def _edit_in_place(model):
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
        model.model.layers[2].mlp.up_proj.weight[3].add_(0.25)
        model.model.layers[0].input_layernorm.weight.mul_(0.7)


def _load_state_dict(model, assign):
    state = {k: v * 1.1 for k, v in tiny(seed=1).state_dict().items()}
    model.load_state_dict(state, strict=False, assign=assign)


def _to_float64(model):
    model.to(torch.float64)


def _through_bfloat16(model):
    model.to(torch.bfloat16).float()


def _data_replaced(model):  # foreign code that swaps a parameter's storage, keeping the object (FSDP, ZeRO-3)
    with torch.no_grad():
        for path in ("self_attn.q_proj", "mlp.gate_proj"):
            weight = model.model.layers[2].get_submodule(path).weight
            weight.data = weight.detach() * 2.0


CHANGES = {"in place": (_edit_in_place, True), "load_state_dict": (lambda m: _load_state_dict(m, False), True),
           "load_state_dict(assign=True)": (lambda m: _load_state_dict(m, True), True),
           ".to(float64)": (_to_float64, True), "bfloat16 and back": (_through_bfloat16, True),
           ".data replaced": (_data_replaced, False)}


@pytest.mark.parametrize("change", list(CHANGES))
def test_the_fused_path_follows_every_change_of_the_weights(change, ids):
    """Each projection weight is a view of the stacked matrix; what replaces parameters relinks them on the next
    call (the fast path again), and a storage swapped behind the module's back is read through `cat` (slow, right)."""
    hooks, fused = pair(update="projected")
    edit, relinked = CHANGES[change]
    for model in (hooks, fused):
        edit(model)
    expected = logits(hooks, ids)
    assert not torch.equal(expected, logits(convert(tiny(), "hooks", update="projected"), ids).to(expected.dtype))
    torch.testing.assert_close(logits(fused, ids), expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())
    assert [e.linked() for e in executions(fused)] == ([True, True] if relinked else [True, False])


def test_training_updates_the_projections_own_parameters(ids):
    hooks, fused = pair()
    before = {n: p.detach().clone() for n, p in fused.named_parameters()}
    for model in (hooks, fused):
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        model.eval()
    layer = fused.model.layers[0]
    for path in PROJECTIONS:
        name = f"model.layers.0.{path}.weight"
        assert not torch.equal(dict(fused.named_parameters())[name], before[name])
        torch.testing.assert_close(layer.get_submodule(path).weight, hooks.model.layers[0].get_submodule(path).weight,
                                   rtol=1e-5, atol=1e-6)
    assert all(e.linked() for e in executions(fused))  # and the stacked matrix is those parameters
    fused.load_state_dict(hooks.state_dict())
    assert torch.equal(logits(fused, ids), logits(hooks, ids))


def test_copies_relink_their_own_parameters(ids):
    hooks, fused = pair()
    copies = {"deepcopy": copy.deepcopy(fused)}
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    copies["pickle"] = torch.load(buffer, weights_only=False)
    expected = logits(hooks, ids)
    for name, clone in copies.items():
        assert torch.equal(logits(clone, ids), expected), name
        assert all(e.linked() for e in executions(clone)), name
        with torch.no_grad():
            clone.model.layers[0].self_attn.q_proj.weight.mul_(2.0)  # the copy's weights, not the original's
        assert not torch.equal(logits(clone, ids), expected), name
    assert torch.equal(logits(fused, ids), expected)


def test_functional_call_reads_the_parameters_it_is_given(ids):
    hooks, fused = pair()
    scaled = {name: p.detach() * 1.05 for name, p in hooks.named_parameters()}
    expected = torch.func.functional_call(hooks, scaled, (ids,)).logits
    with torch.no_grad():
        assert torch.equal(torch.func.functional_call(fused, scaled, (ids,)).logits, expected)
    assert torch.equal(logits(fused, ids), logits(hooks, ids))
    assert all(e.linked() for e in executions(fused))


@pytest.mark.parametrize("arch", ["qwen2", "llama with biases"])
def test_biased_projections(arch, ids):
    base = tiny("llama", attention_bias=True, mlp_bias=True) if arch == "llama with biases" else tiny(arch)
    hooks, fused = convert(copy.deepcopy(base), "hooks"), convert(base, "fused")
    expected = logits(hooks, ids)
    assert torch.equal(logits(fused, ids), expected)
    group = executions(fused)[0].groups[0]
    q_bias = fused.model.layers[0].self_attn.q_proj.bias
    assert q_bias.data_ptr() == group.bias.data_ptr()  # a view of the stacked bias
    with torch.no_grad():
        for model in (hooks, fused):
            model.model.layers[0].self_attn.v_proj.bias.add_(0.5)
    assert torch.equal(logits(fused, ids), logits(hooks, ids))


def test_threads_share_a_model_without_mixing_calls():
    """The FFN norm reuses the input norm's h / rms(h) only for that very h; a call of another thread in
    between costs a recomputation, never a wrong result."""
    model = convert(tiny(), "fused")
    torch.manual_seed(3)
    inputs = [torch.randint(0, 128, (1, 5 + i)) for i in range(4)]
    expected = [logits(model, x) for x in inputs]
    failures = []

    def run(i):
        for _ in range(25):
            if not torch.equal(logits(model, inputs[i]), expected[i]):
                failures.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_unpatch_puts_back_classes_forwards_and_separate_storage(ids):
    base = tiny()
    reference = logits(base, ids)
    norm = base.model.layers[0].input_layernorm
    kernel_forward = norm.forward = types.MethodType(type(norm).forward, norm)  # as kernelize leaves it
    fused = convert(base, "fused")
    assert "forward" not in vars(norm) and type(norm).__name__ == "FusedParallelLlamaRMSNorm"
    assert type(norm).kernel_condition(norm) is False  # kernelize leaves the swapped norm alone
    assert isinstance(fused.model.layers[2].mlp.up_proj, FusedProjection)
    ht.unpatch(fused)
    assert vars(norm)["forward"] is kernel_forward
    plain = tiny().model.layers[0]
    for index in (0, 2):
        layer = fused.model.layers[index]
        for name, module in layer.named_modules():
            assert type(module) is type(plain.get_submodule(name)), name
            assert not {"_fused_parallel", "_fused_group", "_fused_rows"} & set(vars(module)), name
        for path in PROJECTIONS:  # each weight in storage of its own again
            weight = layer.get_submodule(path).weight
            assert weight.untyped_storage().nbytes() == weight.numel() * weight.element_size()
    assert torch.equal(logits(fused, ids), reference)


def test_a_projection_or_branch_replaced_after_the_patch_is_refused(ids):
    model = convert(tiny(), "fused")
    attention = model.model.layers[0].self_attn
    attention.q_proj = nn.Sequential(attention.q_proj)  # as an adapter wraps it
    with pytest.raises(RuntimeError, match=r"'q_proj' of a layer converted with parallel_execution='fused' was replaced "
                                           r"since the patch \(now Sequential.*Use parallel_execution='hooks' with adapters"):
        logits(model, ids)
    model = convert(tiny(), "fused")
    model.model.layers[2].mlp = copy.deepcopy(model.model.layers[2].mlp)
    with pytest.raises(RuntimeError, match=r"'mlp' of a layer converted with parallel_execution='fused' was replaced"):
        logits(model, ids)


def test_projections_of_different_dtypes_are_refused_by_name(ids):
    model = convert(tiny(), "fused")
    model.model.layers[0].self_attn.q_proj.to(torch.float64)
    with pytest.raises(RuntimeError, match=r"input projections of a parallel_execution='fused' layer of LlamaDecoderLayer "
                                           r"have different dtypes or devices.*accepted: one dtype and one device per layer"):
        logits(model, ids)


def test_layers_the_fused_path_cannot_compute_are_refused_at_patch_time():
    model = tiny()
    norm = model.model.layers[0].post_attention_layernorm

    class GainPlusOne(type(norm)):  # Gemma's (1 + w) gain: not w * h / rms(h)
        def forward(self, h):
            return (1.0 + self.weight) * super().forward(h) / self.weight

    norm.__class__ = GainPlusOne
    with pytest.raises(ValueError, match="computes w \\* h / rms\\(h\\) for GainPlusOne, whose forward computes something "
                                         "else; use parallel_execution='hooks'"):
        convert(model, "fused")
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear and ht.get_config(model) is None

    class QuantisedLinear(nn.Linear):
        pass

    model = tiny()
    model.model.layers[2].mlp.up_proj.to(torch.float64)
    with pytest.raises(ValueError, match="needs each branch's input projections in one dtype on one device"):
        convert(model, "fused")
    model = tiny()
    model.model.layers[2].mlp.up_proj.__class__ = QuantisedLinear
    with pytest.raises(ValueError, match="needs plain floating-point nn.Linear input projections reading the hidden "
                                         "size 64"):
        convert(model, "fused")
    assert ht.get_config(model) is None


def test_an_aborted_call_leaves_no_normalised_input_for_the_next(ids):
    """The input norm's (h, h / rms(h)) outlived a call that raised inside the attention; a later call on the very
    same (in-place changed) input tensor reused the stale normalisation (fresh-eyes review)."""
    fused, hooks = convert(tiny(), "fused"), convert(tiny(), "hooks")
    emb = fused.model.embed_tokens(ids).detach().clone()

    def out_of_memory(module, args):
        raise RuntimeError("simulated OOM")

    handle = fused.model.layers[0].self_attn.o_proj.register_forward_pre_hook(out_of_memory)
    with pytest.raises(RuntimeError, match="simulated OOM"), torch.no_grad():
        fused(inputs_embeds=emb)
    handle.remove()
    with torch.no_grad():
        emb.add_(torch.randn_like(emb))
        assert (fused(inputs_embeds=emb).logits - hooks(inputs_embeds=emb).logits).abs().max() < 1e-5


def test_savers_that_drop_shared_storages_write_every_weight(tmp_path, ids):
    """The projections' weights are views of the stacked weight: accelerate's save_model dropped k, v and up as
    'shared tensors' and safetensors' save_model refused; the state dict now gives them storages of their own."""
    from accelerate import Accelerator
    from safetensors.torch import load_file, save_model

    model = convert(tiny(), "fused")
    save_model(model, str(tmp_path / "st.safetensors"))
    Accelerator().save_model(model, tmp_path / "acc")
    expected = {k: v for k, v in model.state_dict().items()}
    for path in (tmp_path / "st.safetensors", tmp_path / "acc" / "model.safetensors"):
        saved = load_file(path)
        assert set(saved) == set(expected)
        assert all(torch.equal(saved[k], expected[k]) for k in expected)


def test_a_fused_folder_loads_exactly_through_its_remote_code_which_runs_the_layers_with_hooks(ids, tmp_path):
    """Issue 59: a saved folder does not ship fused_parallel.py (281 lines); without hf_tangent its copy runs the
    layers of a parallel_execution='fused' record with the hooks: the same layers, the same logits (bit for bit in
    float32 on this CPU). The record stays 'fused' (a re-save through the copy loads fused again where hf_tangent
    is installed), and so does what it refuses: a lambda below 1 on a fused layer. With hf_tangent installed the
    package's own fused execution runs."""
    import subprocess

    from transformers import AutoModelForCausalLM

    fused = convert(tiny(), "fused", update="norm_preserving")
    expected = logits(fused, ids)
    fused.save_pretrained(tmp_path / "folder")
    installed = AutoModelForCausalLM.from_pretrained(tmp_path / "folder", trust_remote_code=True).eval()
    assert torch.equal(logits(installed, ids), expected)
    assert all(e is not None and e.linked() for e in executions(installed))  # linked at its first call
    torch.save(ids, tmp_path / "ids.pt")
    script = f"""
import sys, torch
sys.modules["hf_tangent"] = None
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "folder")!r}, trust_remote_code=True).eval()
assert not any("Fused" in type(m).__name__ for m in model.modules())
assert model.config.hf_tangent["config"]["parallel_execution"] == "fused"
with torch.no_grad():
    torch.save(model(torch.load({str(tmp_path / "ids.pt")!r})).logits, {str(tmp_path / "out.pt")!r})
model.save_pretrained({str(tmp_path / "again")!r})
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert torch.equal(torch.load(tmp_path / "out.pt"), expected)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again", trust_remote_code=True).eval()
    assert torch.equal(logits(again, ids), expected) and all(e is not None for e in executions(again))
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    config["hf_tangent"]["homotopy"] = {"lambda": 0.5, "schedule": None, "steps": None}  # a hand edit
    (tmp_path / "again" / "config.json").write_text(json.dumps(config))
    script = script.replace(str(tmp_path / "folder"), str(tmp_path / "again"))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            stdin=subprocess.DEVNULL)
    assert result.returncode != 0 and "which run with parallel_execution='fused'" in result.stderr, result.stderr[-3000:]
