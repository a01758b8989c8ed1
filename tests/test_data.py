"""Text loading, the by-novel split, packing into windows, and the Debian Austen extraction."""

import shutil

import pytest
from conftest import SHARED_AUSTEN

from hf_tangent.artifacts.models import load_tokenizer
from hf_tangent.training import data


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


def test_calibration_and_evaluation_novels_never_overlap(austen_dir):
    calibration = set(data.AUSTEN_SPLITS["calibration"])
    evaluation = set(data.AUSTEN_SPLITS["evaluation"])
    assert not calibration & evaluation
    cal_docs = data.load_documents(split="calibration")
    eval_docs = data.load_documents(split="evaluation")
    assert len(cal_docs) == 3 and len(eval_docs) == 2
    cal_lines = {line for doc in cal_docs for line in doc.splitlines() if len(line) > 60}
    eval_lines = {line for doc in eval_docs for line in doc.splitlines() if len(line) > 60}
    assert len(cal_lines) > 1000 and len(cal_lines & eval_lines) < 5  # only stock phrases may repeat
    assert eval_docs[0].startswith("EMMA") and "Emma Woodhouse" in eval_docs[0]


def test_load_documents_from_files_one_document_per_file(tmp_path):
    (tmp_path / "a.txt").write_text("First line.\nSecond line.\n")
    (tmp_path / "b.txt").write_text("Another document.")
    docs = data.load_documents([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")])
    assert [d.strip() for d in docs] == ["First line.\nSecond line.", "Another document."]


def test_bad_text_inputs_are_clear_errors(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="text files not found"):
        data.load_documents([str(tmp_path / "missing.txt")])
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="hold no text"):
        data.load_documents([str(tmp_path / "empty.txt")])
    with pytest.raises(ValueError, match="fewer than one window of seq_len=512"):
        data.pack_windows(tokenizer, ["Just a few words."], 512)
    with pytest.raises(ValueError, match="documents are empty"):
        data.pack_windows(tokenizer, [], 16)
    with pytest.raises(ValueError, match="unknown Austen split 'train'"):
        data.austen_files("train")


def test_unknown_hub_dataset_is_a_clear_error():
    # The tests run with HF_HUB_OFFLINE (conftest): a hub dataset is refused as needing the Hub, by name,
    # with the offline alternatives.
    from hf_tangent.artifacts.offline import HubUnavailableError

    with pytest.raises(HubUnavailableError, match="dataset 'no-such/dataset-xyz'.*needs the Hugging Face Hub.*--text-files"):
        data.load_documents(dataset="no-such/dataset-xyz")


def test_pack_windows_concatenates_documents_with_eos(tokenizer):
    docs = ["It is a truth universally acknowledged.", "Emma Woodhouse, handsome, clever, and rich."]
    stream = []
    for doc in docs:
        stream += tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    windows = data.pack_windows(tokenizer, docs, 5)
    assert windows.shape == (len(stream) // 5, 5)
    assert windows.flatten().tolist() == stream[: windows.numel()]
    assert data.pack_windows(tokenizer, docs, 5, max_windows=2).shape == (2, 5)


def test_windows_start_with_bos_where_the_tokenizer_adds_it(tokenizer):
    """Gemma's tokenizer starts every text with BOS and the model needs it (its loss on Austen is
    ~1.3 nats higher without); SmolLM2's does not, and its windows stay as they were."""

    class BosTokenizer:  # SmolLM2's vocabulary, with the BOS behaviour of Gemma's tokenizer
        bos_token_id, eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id

        def __call__(self, text, add_special_tokens=True):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            return {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + ids}

    docs = ["It is a truth universally acknowledged.", "Emma Woodhouse, handsome, clever, and rich."]
    stream = []
    for doc in docs:
        stream += tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    windows = data.pack_windows(BosTokenizer(), docs, 5)
    assert windows.shape == (len(stream) // 4, 5)
    assert (windows[:, 0] == tokenizer.bos_token_id).all()
    assert windows[:, 1:].flatten().tolist() == stream[: windows.shape[0] * 4]
    assert tokenizer("a")["input_ids"][0] != tokenizer.bos_token_id  # SmolLM2: no BOS added


@pytest.mark.network
@pytest.mark.skipif(shutil.which("apt-get") is None, reason="needs Debian's apt-get")
def test_austen_extracted_from_debian_matches_the_shared_copy(tmp_path, monkeypatch):
    """`apt-get download` on every run: only with -m network (the default suite stays offline)."""
    monkeypatch.delenv("HF_TANGENT_AUSTEN_DIR", raising=False)
    monkeypatch.setenv("HF_TANGENT_CACHE", str(tmp_path))
    folder = data.austen_dir()
    assert folder == tmp_path / "austen"
    for name in data.AUSTEN_NOVELS:
        text = (folder / f"{name}.txt").read_text(encoding="utf-8")
        assert len(text) > 400_000
        if SHARED_AUSTEN.is_dir():
            assert text == (SHARED_AUSTEN / f"{name}.txt").read_text(encoding="utf-8"), name
