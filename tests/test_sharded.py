"""Sharded training (issue 12): 2 processes over gloo on this CPU, through torch's FSDP1/FSDP2 APIs
(accelerate turns FSDP into DDP on CPU) and DeepSpeed ZeRO-3 through the HF Trainer when
deepspeed is installed. Each run is compared with the same training on one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import hf_tangent as ht

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args: list[str], timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    start = time.time()
    result = torchrun([str(HERE / "sharded_worker.py"), str(out)])
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return out, ranks, time.time() - start


def scenarios():
    from sharded_worker import SCENARIOS

    return [f"{e}-{a}-{m}" for e, a, m in SCENARIOS]


@pytest.mark.parametrize("name", scenarios())
def test_sharded_training_matches_one_process(sharded_runs, name):
    _, ranks, _ = sharded_runs
    rows = [next(r for r in rank if f"{r['engine']}-{r['arch']}-{r['mode']}" == name) for rank in ranks]
    for row in rows:
        assert "error" not in row, row.get("error")
        assert row["get_config"] and row["tangent_layers"] == 3
        for target, message in row["refusals"].items():
            assert "patch before wrapping" in message, (target, message)
    assert rows[0]["gates"] == rows[1]["gates"]  # every rank reads the same, whole gate values
    row = rows[0]
    if "reference_losses" in row:  # bf16 mixed precision has no bitwise single-process twin
        torch.testing.assert_close(torch.tensor(row["losses"]), torch.tensor(row["reference_losses"]), rtol=0, atol=1e-5)
        for layer, value in row["reference_gates"].items():
            assert abs(row["gates"][layer] - value) <= 1e-6, (layer, row["gates"][layer], value)
    assert any(abs(v - 1.0) > 1e-3 for v in row["gates"].values()), "the gates must have trained"
    if "unpatch_max_diff" in row:
        assert row["unpatch_max_diff"] == 0.0 and row["unpatched_config"]


def test_saved_sharded_models_reload_in_a_fresh_process(sharded_runs):
    out, ranks, _ = sharded_runs
    names = [f"{r['engine']}-{r['arch']}-{r['mode']}" for r in ranks[0] if "reference_losses" in r]
    script = textwrap.dedent(f"""
        import json, torch, hf_tangent as ht
        from hf_tangent.training.trainer import gate_values
        from sharded_worker import eval_logits
        out = {{}}
        for name in {names!r}:
            folder = {str(out)!r} + "/" + name
            model = ht.from_pretrained(folder, dtype=torch.bfloat16 if "bf16" in name else torch.float32).eval()
            diff = (eval_logits(model) - torch.load(folder + "/reference_logits.pt")).abs().max().item()
            out[name] = {{"diff": diff, "gates": gate_values(model),
                          "architectures": json.load(open(folder + "/config.json"))["architectures"]}}
        print(json.dumps(out))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=HERE)
    assert result.returncode == 0, result.stderr[-3000:]
    reloaded = json.loads(result.stdout.strip().splitlines()[-1])
    for row in ranks[0]:
        name = f"{row['engine']}-{row['arch']}-{row['mode']}"
        if name in reloaded:
            # bf16: the reference cast its rotary buffer to bf16 with .to(), a reload keeps it in float32 (1 ulp)
            assert reloaded[name]["diff"] <= (0.05 if "bf16" in name else 1e-5), (name, reloaded[name]["diff"])
            assert {int(k): v for k, v in row["gates"].items()} == {int(k): v for k, v in reloaded[name]["gates"].items()}
            # the patched format's name for the base class (not FSDP2's in-place "FSDPLlamaForCausalLM")
            assert reloaded[name]["architectures"][0] in ("HfTangentLlamaForCausalLM", "HfTangentGPT2LMHeadModel"), \
                reloaded[name]


def test_hub_folder_of_an_fsdp2_model_loads_without_hf_tangent(sharded_runs, tmp_path):
    from conftest import VOCAB, logits_without_hf_tangent
    from sharded_worker import BATCH, SEQ

    out, _, _ = sharded_runs
    folder = out / "fsdp2-llama-full-hub"
    config = json.loads((folder / "config.json").read_text())
    # the base class (not FSDP2's in-place subclass "FSDPLlamaForCausalLM") under the patched format's name
    assert config["architectures"] == ["HfTangentLlamaForCausalLM"] and "auto_map" in config
    assert config["hf_tangent"]["base_architecture"] == "LlamaForCausalLM"
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))[:2]  # eval_logits
    logits = logits_without_hf_tangent(folder, ids, tmp_path).float()
    assert (logits - torch.load(out / "fsdp2-llama-full" / "reference_logits.pt")).abs().max() <= 1e-5


def test_fsdp1_with_mixed_dtypes_is_refused_with_what_to_set(monkeypatch, tmp_path):
    from conftest import make_tiny

    from hf_tangent.training.trainer import train, training_arguments

    model = ht.patch(make_tiny("llama").to(torch.bfloat16), ht.TangentConfig(gates=True))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    args = training_arguments(str(tmp_path), max_steps=1, learning_rate=1e-3, batch_size=1)
    with pytest.raises(ValueError, match=r"FSDP1 .* one dtype.*load the model in float32.*fsdp_version: 2"):
        train(model, None, args)
    monkeypatch.setenv("FSDP_VERSION", "2")  # FSDP2 keeps each parameter's dtype: no objection
    from hf_tangent.training.trainer import check_sharding

    check_sharding(model)


@pytest.mark.skipif(not __import__("importlib").util.find_spec("deepspeed"),
                    reason="DeepSpeed ZeRO-3 needs the optional extra: pip install --no-build-isolation deepspeed")
def test_zero3_matches_one_process(tmp_path):
    """ZeRO-3 through DeepSpeed's own engine (accelerate runs no DeepSpeed on a CPU-only machine: its
    state reports one process), stage3_param_persistence_threshold=0 so the tiny model is partitioned."""
    from sharded_worker import ZERO3_SCENARIOS

    names = [f"{e}-{a}-{m}" for e, a, m in ZERO3_SCENARIOS]
    result = torchrun([str(HERE / "sharded_worker.py"), str(tmp_path), *names])
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rows in zip(*ranks, strict=True):
        for row in rows:
            assert "error" not in row, row.get("traceback")
            assert all("patch before wrapping" in m for m in row["refusals"].values())
        assert rows[0]["gates"] == rows[1]["gates"]
        row = rows[0]
        torch.testing.assert_close(torch.tensor(row["losses"]), torch.tensor(row["reference_losses"]), rtol=0, atol=1e-5)
        assert max(abs(row["gates"][k] - v) for k, v in row["reference_gates"].items()) <= 1e-6
        if "unpatch_max_diff" in row:
            assert row["unpatch_max_diff"] == 0.0
    for name in names:  # the full state dict gathered from the partitions reloads
        model = ht.from_pretrained(tmp_path / name, dtype=torch.bfloat16 if "bf16" in name else torch.float32)
        assert len(ht.tangent_layers(model)) == 3


def test_shipped_accelerate_configs_load():
    from importlib import resources

    from accelerate.commands.config.config_args import load_config_from_file

    folder = resources.files("hf_tangent.recipes") / "accelerate"
    configs = {p.name: load_config_from_file(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}
    assert set(configs) == {"ddp.yaml", "fsdp2.yaml", "zero3.yaml"}
    assert configs["fsdp2.yaml"].fsdp_config["fsdp_version"] == 2
    assert configs["zero3.yaml"].deepspeed_config["zero_stage"] == 3
    assert configs["zero3.yaml"].deepspeed_config["zero3_init_flag"] is False
