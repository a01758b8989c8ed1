"""Shared fixtures: random tiny models of every registered architecture, and the real text."""

from __future__ import annotations

import functools
import json
import os

# Tests never reach the hub (nor does CI): fail fast instead of retrying for seconds.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Without a GPU, Triton kernels run in triton's interpreter on CPU tensors (read when a kernel is
# decorated, so before anything imports hf_tangent.core.triton_update).
if os.environ.get("HF_TANGENT_TEST_CUDA") != "1" and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
from pathlib import Path

import pytest
import torch
import torch.utils.collect_env
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

import hf_tangent as ht

# lm-eval's simple_evaluate describes the environment on every call with torch's collect_env (`pip list`
# and other subprocesses: about a second each time here); the suite evaluates dozens of times in one
# process, and the environment does not change within it: the real description, taken once per process.
torch.utils.collect_env.get_pretty_env_info = functools.cache(torch.utils.collect_env.get_pretty_env_info)

VOCAB = 128
SHARED_AUSTEN = Path(__file__).resolve().parents[2] / "shared" / "data" / "austen"
# The real text the tests read: the five novels from ../shared when present, else the openings kept
# under tests/data/austen (tests/data/README.md). Never apt, never the network.
AUSTEN = SHARED_AUSTEN if SHARED_AUSTEN.is_dir() else Path(__file__).resolve().parent / "data" / "austen"
# hf_tangent's default corpus (data.austen_dir) reads AUSTEN too: set at import, before any fixture (a
# module-scoped fixture runs before function-scoped autouse ones), so nothing reaches apt or a cache.
os.environ.setdefault("HF_TANGENT_AUSTEN_DIR", str(AUSTEN))
# The mixed corpus (heal's default text), the same way: built from the kept excerpts of the Debian
# files (tests/data/corpora) into a temporary folder, never from apt.
CORPUS_EXCERPTS = Path(__file__).resolve().parent / "data" / "corpora" / "root"


def _kept_corpus() -> str:
    import atexit
    import shutil
    import tempfile

    from hf_tangent.training.corpora import debian

    folder = Path(tempfile.mkdtemp(prefix="hf_tangent_test_corpus_"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    debian.build_corpus(CORPUS_EXCERPTS, folder, {}, debian.Sizes(document_words=300, min_document_words=50,
                                                                   heldout_min_words=0, heldout_max_words=10**9,
                                                                   train_max_words=10**9))
    return str(folder)


if "HF_TANGENT_CORPUS_DIR" not in os.environ:
    os.environ["HF_TANGENT_CORPUS_DIR"] = _kept_corpus()


def _llama_kwargs():
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


# name -> (model class, config factory). GPT-NeoX appears twice: parallel (Pythia's default) and sequential.
TINY = {
    "gpt2": (GPT2LMHeadModel, lambda: GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=128)),
    "gpt_neox_parallel": (GPTNeoXForCausalLM, lambda: GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=128, use_parallel_residual=True)),
    "gpt_neox_sequential": (GPTNeoXForCausalLM, lambda: GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=128, use_parallel_residual=False)),
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**_llama_kwargs())),
    "mistral": (MistralForCausalLM, lambda: MistralConfig(**_llama_kwargs(), sliding_window=None)),
}
ARCHS = list(TINY)


def make_tiny(name: str, seed: int = 0, **config_overrides):
    cls, make_config = TINY[name]
    config = make_config()
    for key, value in config_overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = cls(config).eval()
    # Random init leaves the FFN output tiny next to the residual; scale the weights up so that
    # every rule changes the logits visibly and the tests can tell the rules apart.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture
def ids() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, VOCAB, (2, 12))  # (batch, seq)


def spec_of(model):
    return ht.core.discovery.get_spec(model.config.model_type)


def layer_output(output):
    return output[0] if isinstance(output, tuple) else output


@pytest.fixture
def austen_dir() -> Path:
    """The five novels (AUSTEN): whole from ../shared, or their openings kept under tests/data."""
    return AUSTEN


def tiny_smollm2_llama(folder: Path | None = None, *, hidden_size: int = 32, layers: int = 2,
                       max_positions: int = 64, **config):
    """A random tiny Llama (seed 0) with the real SmolLM2 tokenizer; saved as a plain transformers folder
    when `folder` is given. Returns (model, tokenizer)."""
    from hf_tangent.artifacts.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size,
                                         intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=max_positions, **config)).eval()
    if folder is not None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return model, tokenizer


@pytest.fixture(scope="session")
def tiny_lm_folder(tmp_path_factory) -> Path:
    """A random tiny Llama with the real SmolLM2 tokenizer, saved as a plain transformers folder."""
    folder = tmp_path_factory.mktemp("tiny_lm")
    tiny_smollm2_llama(folder)
    return folder


_REMOTE_CODE_SCRIPT = """
import sys, torch
sys.modules["hf_tangent"] = None  # import hf_tangent fails here: the folder's remote code alone
from transformers import AutoModelForCausalLM
folder, io = sys.argv[1], sys.argv[2]
try:  # without the remote code a patched folder is refused, never loaded as its unpatched base
    AutoModelForCausalLM.from_pretrained(folder)
    raise SystemExit("a plain AutoModelForCausalLM.from_pretrained loaded the patched folder")
except ValueError as err:
    assert "trust_remote_code=True" in str(err), err
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
assert type(model).__name__.startswith("HfTangent"), type(model)
with torch.no_grad():
    torch.save(model(torch.load(io)).logits, io)
patches = {type(m).__module__ for m in model.modules() if type(m).__name__ == "TangentLayer"}
assert patches and all(p.startswith("transformers_modules.") for p in patches), patches  # the folder's own core
"""


def logits_without_hf_tangent(folder, ids: torch.Tensor, tmp_path: Path) -> torch.Tensor:
    """The logits of a saved patched folder loaded by plain transformers in a fresh process, in which
    hf_tangent is never imported: with trust_remote_code=True (patched, by the folder's remote code);
    the same load without it must be refused (checked there too)."""
    import subprocess
    import sys

    io = tmp_path / "remote_code_io.pt"
    torch.save(ids, io)
    result = subprocess.run([sys.executable, "-c", _REMOTE_CODE_SCRIPT, str(folder), str(io)], capture_output=True,
                            text=True, timeout=300, cwd=tmp_path, stdin=subprocess.DEVNULL,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(io)


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """The suite runs offline: a connection to anything but this machine fails the test that makes it
    (loopback stays open for the gloo process groups of the multi-process tests)."""
    import ipaddress
    import socket

    connect = socket.socket.connect

    def guarded(sock, address):
        host = address[0] if isinstance(address, tuple) else None
        if host is not None and host != "localhost":
            try:
                local = ipaddress.ip_address(host.split("%")[0]).is_loopback
            except ValueError:
                local = False
            if not local:
                raise OSError(f"tests run offline: a connection to {address!r} was attempted")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)


def nll_with_ffn_rule(model, windows: torch.Tensor, rule=None) -> float:
    """Mean next-token NLL of a Llama-layout model whose layer i adds rule(x, y, i) instead of y
    (x: the pre-FFN norm's input, y: the MLP output; float64), written with plain torch hooks: an
    independent check of what hf_tangent's patch and its reports compute. rule=None: the model."""
    handles = []
    for i, layer in enumerate(model.model.layers if rule is not None else []):
        seen = {}
        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(
            lambda m, a, seen=seen: seen.__setitem__("x", a[0])))
        handles.append(layer.mlp.register_forward_hook(
            lambda m, a, y, seen=seen, i=i: rule(seen["x"].double(), y.double(), i).to(y.dtype)))
    try:
        with torch.no_grad():
            losses = [model(w[None], labels=w[None]).loss.item() for w in windows]
    finally:
        for handle in handles:
            handle.remove()
    return sum(losses) / len(losses)


def projected(x: torch.Tensor, y: torch.Tensor, layer: int | None = None, eps: float = 1e-6) -> torch.Tensor:
    """y - <x, y> / (||x||^2 + eps) x (math.md), per token (the same in every layer)."""
    return y - (x * y).sum(-1, keepdim=True) / ((x * x).sum(-1, keepdim=True) + eps) * x


def pytest_collection_modifyitems(config, items):
    """The Triton kernels' tests first, while the process is young: once (a clean-clone CI run,
    2026-12-03) triton 3.9's interpreter crashed with a segfault in the custom op's dispatch on the first
    kernel call, after about 1000 other tests in the same process; test_triton.py alone, after the tests of
    the C update kernel of that time (removed since, issue 46), and after 300 tests under AddressSanitizer
    passed. Only the order changes."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        items.sort(key=lambda item: item.nodeid.split("::")[0] != "tests/test_triton.py")


def as_format_2(folder):
    """The same patch repo in format 2, as hf_tangent 0.4 wrote it: hf_tangent_patch.json (the patched config's
    record, architecture included) + gates.safetensors (+ adapter/)."""
    from safetensors.torch import load_file, save_file

    from hf_tangent.artifacts.patch_repo import read_record
    from hf_tangent.core import discovery

    folder = Path(folder)
    record = dict(read_record(folder), format=2)
    record["gates"] = "gates.safetensors" if record["gates"] else None
    if record["base"]["model_type"] in discovery.supported_model_types():  # 0.4 recorded the spec it patched with
        record["patch"] = dict(record["patch"], architecture=discovery.get_spec(record["base"]["model_type"]).to_dict(),
                               base_architecture=record["base"]["architecture"])
    gates = load_file(folder / "adapter_model.safetensors")
    if record["gates"]:
        save_file({f"layer.{int(k.split('.tangent_patch')[0].rsplit('.', 1)[1])}": v for k, v in gates.items()},
                  folder / "gates.safetensors", metadata={"format": "hf_tangent_gates"})
    (folder / "hf_tangent_patch.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (folder / name).unlink()
    return folder


def waits_in_flock(thread, seconds: float = 60.0) -> bool:
    """Whether `thread` comes to wait in destinations._lock's flock (polled from its stack)."""
    import linecache
    import sys
    import time

    for _ in range(int(seconds / 0.05)):
        frame = sys._current_frames().get(thread.ident)
        while frame is not None:
            if frame.f_code.co_name == "_lock" and "flock" in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
                return True
            frame = frame.f_back
        if not thread.is_alive():
            return False
        time.sleep(0.05)
    return False
