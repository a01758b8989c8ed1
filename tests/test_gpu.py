"""The core suite on CUDA (marker `gpu`; skipped without a GPU): patch/unpatch bit-exact, every rule
against an independent float64 computation, save/reload, generate with the KV cache, gradient
checkpointing, bf16, SDPA, LoRA, compile without graph breaks, the fused parallel path, the Triton
kernels inside a model, and calibration at smoke size. benchmarks/gpu_check.py runs it."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny
from test_patching import RULES, expected_delta, run_capture

import hf_tangent as ht

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_check.py)")]
CUDA = "cuda"
ARCHS = ["gpt2", "gpt_neox_parallel", "llama", "mistral"]


def tiny(arch, **kw):
    return make_tiny(arch, **kw).to(CUDA)


@pytest.fixture
def cids(ids):
    return ids.to(CUDA)


@pytest.mark.parametrize("arch", ARCHS)
def test_patch_unpatch_bit_exact_and_gates_on_the_device(arch, cids):
    model = tiny(arch)
    with torch.no_grad():
        reference = model(cids).logits
        ht.patch(model, ht.TangentConfig(update="add", gates=True))
        assert all(c.gate.device.type == "cuda" for c in ht.tangent_layers(model))
        assert torch.equal(model(cids).logits, reference)
        ht.patch(model, ht.TangentConfig(update="retract", retraction="cayley", gates=True))
        assert not torch.equal(model(cids).logits, reference)
        ht.unpatch(model)
        assert torch.equal(model(cids).logits, reference)


@pytest.mark.parametrize("implementation", ["fused", "triton"])
@pytest.mark.parametrize("rule", RULES, ids=lambda c: f"{c.update}-p{c.p}")
def test_every_rule_against_float64_on_cuda(rule, implementation, cids):
    if implementation == "triton":
        pytest.importorskip("triton")
    model = tiny("llama")
    plain = run_capture(model, cids)
    config = ht.TangentConfig.from_dict({**rule.to_dict(), "layers": [1], "implementation": implementation})
    patched = run_capture(ht.patch(model, config), cids)
    expected = plain["out"] - plain["y"] + expected_delta(config, plain["x"], plain["y"])
    torch.testing.assert_close(patched["out"], expected, rtol=0, atol=5e-6 * plain["out"].abs().max())


def test_save_reload_and_generate_with_kv_cache(tmp_path, cids):
    model = ht.patch(tiny("llama"), ht.TangentConfig(update="projected", gates=True, implementation="triton"))
    model.save_pretrained(tmp_path)
    reloaded = ht.from_pretrained(tmp_path).to(CUDA).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(cids).logits, model.eval()(cids).logits)
        kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(reloaded.generate(cids, use_cache=True, **kwargs), reloaded.generate(cids, use_cache=False, **kwargs))


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_same_gradients(reentrant, cids):
    model = ht.patch(tiny("llama"), ht.TangentConfig(update="retract", retraction="cayley", gates=True)).train()
    model(cids, labels=cids).loss.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model(cids, labels=cids).loss.backward()
    for name, grad in reference.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("implementation", ["fused", "triton"])
def test_bf16_sdpa_and_float32_arithmetic(implementation, cids):
    if implementation == "triton":
        pytest.importorskip("triton")
    model = make_tiny("llama", attn_implementation="sdpa").to(CUDA, torch.bfloat16)
    ht.patch(model, ht.TangentConfig(update="projected", implementation=implementation))
    rec = run_capture(model, cids)
    x, added = rec["x"], rec["added"]
    cos = (x * added).sum(-1).abs() / (x.norm(dim=-1) * added.norm(dim=-1))
    assert cos.max() < 2e-2  # projected in float32, rounded once to bf16


def test_lora_on_top_trains(cids):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(ht.patch(tiny("llama"), ht.TangentConfig(update="projected")),
                           LoraConfig(r=4, target_modules=["q_proj", "down_proj"])).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(6):
        loss = model(cids, labels=cids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("implementation", ["fused", "triton"])
def test_compile_inductor_no_graph_break(implementation, cids):
    if implementation == "triton":
        pytest.importorskip("triton")
    model = ht.patch(tiny("llama"), ht.TangentConfig(update="projected", implementation=implementation)).eval()
    torch._dynamo.reset()
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(cids)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        torch.testing.assert_close(torch.compile(model, fullgraph=True)(cids).logits, model(cids).logits,
                                   rtol=1e-3, atol=1e-3)


def test_fused_parallel_path_matches_hooks(cids):
    out = {}
    for execution in ("hooks", "fused"):
        model = ht.patch(tiny("llama"), ht.TangentConfig(parallel_layers=[0, 1], parallel_execution=execution))
        with torch.no_grad():
            out[execution] = model(cids).logits
    torch.testing.assert_close(out["fused"], out["hooks"], rtol=1e-4, atol=1e-4)


def test_calibrate_at_smoke_size(tiny_lm_folder, austen_dir, tmp_path):
    args = ht.TangentTrainingArguments(output_dir=str(tmp_path), max_steps=3, learning_rate=0.02,
                                       per_device_train_batch_size=2, per_device_eval_batch_size=2)
    text = ht.TextSource(text_files=(str(austen_dir / "emma.txt"),), calibration_files=(str(austen_dir / "prideprejudice.txt"),))
    report = ht.calibrate_gates(str(tiny_lm_folder), text=text, seq_len=32, max_windows=2, train_windows=4,
                                training_args=args, progress=False)
    assert report["device"] == "cuda" and all(abs(g - 1.0) > 1e-4 for g in report["gates"].values())


def test_heal_full_method_runs_teacher_and_student_on_the_gpu(tmp_path):
    """--method full: the frozen teacher copy is created on the CPU and must follow the student."""
    import copy

    from hf_tangent.training.healing import heal_trainer_class
    from hf_tangent.training.trainer import lm_dataset, train, training_arguments

    base = make_tiny("llama")
    teacher = copy.deepcopy(base)
    model = ht.patch(base, ht.TangentConfig(update="projected"))
    args = training_arguments(str(tmp_path), max_steps=2, learning_rate=1e-4, batch_size=2, device="cuda")
    trainer = train(model, lm_dataset(torch.randint(0, 128, (8, 16))), args, trainer_class=heal_trainer_class(),
                    teacher=teacher)
    assert next(teacher.parameters()).device.type == "cuda" == next(model.parameters()).device.type
    assert trainer.state.global_step == 2
