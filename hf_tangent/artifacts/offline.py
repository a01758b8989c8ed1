"""One error for a call that needs the Hugging Face Hub where the Hub cannot be reached (no network, or
HF_HUB_OFFLINE set): it names the Hub, the call, and what to do offline, instead of huggingface_hub's,
httpx's or requests' own error from deep inside the call."""

from __future__ import annotations

import contextlib
import os

HUB = "the Hugging Face Hub (https://huggingface.co)"

# the names of what huggingface_hub, httpx, requests and the socket layer raise when the Hub is not reachable
_UNREACHABLE = {"OfflineModeIsEnabled", "LocalEntryNotFoundError", "TransportError", "ConnectError", "ConnectTimeout",
                "TimeoutException", "ConnectionError", "Timeout", "NameResolutionError", "NewConnectionError",
                "MaxRetryError"}
_CONNECT_TEXT = ("couldn't connect to", "offline mode is enabled", "cannot reach https://huggingface.co")

ADVICE = {
    "push": "write it to a folder instead (ht.save_patch(model, 'my-patch') for a patch repo, model.save_pretrained("
            "'my-folder') or ht.save_hub_folder(model, 'my-folder', tokenizer=tokenizer) for a complete one) and push "
            "that folder from a machine with a network: ht.push_patch('my-patch', repo_id) or "
            "ht.push_to_hub('my-folder', repo_id)",
    # ht.from_pretrained, hf-tangent export --patch, lm-eval's model_folders: a local folder or a hub repo
    "load": "load a local folder instead (one written by ht.save_patch or save_pretrained, or a copy of the repo; a "
            "patch repo's base from a local copy: base_model='/path/to/base')",
    # ht.load_model and --model take hf_tangent's offline model names as well
    "model": "name an offline model (smollm2-135m, smollm2-135m-mistral, gemma3-270m) or a local folder instead",
    "dataset": "pass local UTF-8 text files (--text-files, or ht.TextSource(text_files=...)), or leave the text out "
               "for the offline default (the held-out Austen novels)",
}


class HubUnavailableError(RuntimeError):
    """A call that needs the Hub, where the Hub cannot be reached: the message names the call, the Hub,
    why, and what to do offline."""


def hub_offline() -> bool:
    """HF_HUB_OFFLINE is set (huggingface_hub's own reading of it)."""
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    return bool(constants.HF_HUB_OFFLINE)


def unreachable(err: BaseException | None) -> str | None:
    """Why the Hub could not be reached, if `err` (or an error it was raised from) says so; else None. The
    reason is the innermost such error (the connection's own, not a wrapper's)."""
    seen, found = set(), None
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        names = {kind.__name__ for kind in type(err).__mro__}
        if names & _UNREACHABLE or any(phrase in str(err).lower() for phrase in _CONNECT_TEXT):
            found = err
        err = err.__cause__ or err.__context__
    if found is None:
        return None
    if hub_offline():
        return "HF_HUB_OFFLINE is set"
    text = " ".join(str(found).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(found).__name__}: {text}" if text else type(found).__name__


def hub_error(call: str, kind: str, reason: str) -> HubUnavailableError:
    cache = "" if kind not in ("load", "model") else (
        "; the repo (or a file of it) is not in your Hugging Face cache, the only place a hub id is read from with "
        "HF_HUB_OFFLINE set" if hub_offline() else "; a repo already in your Hugging Face cache loads with "
        "HF_HUB_OFFLINE=1 set")
    return HubUnavailableError(f"hf_tangent: {call} needs {HUB}, which cannot be reached from here ({reason}). "
                               f"Offline: {ADVICE[kind]}{cache}.")


@contextlib.contextmanager
def needs_hub(call: str, kind: str):
    """Around a call that reaches the Hub: an error that comes from the Hub being unreachable becomes one
    HubUnavailableError naming `call` and what to do offline (`kind`: push, load, model, dataset); any other error
    passes unchanged."""
    try:
        yield
    except HubUnavailableError:
        raise
    except Exception as err:
        reason = unreachable(err)
        if reason is None:
            raise
        raise hub_error(call, kind, reason) from err
