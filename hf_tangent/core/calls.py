"""Per-call keys: what a layer's hooks hand each other is stored under the calling thread's key,
so two threads running one model never see each other's tensors."""

from __future__ import annotations

import threading

import torch


def call_key() -> int:
    """Who is calling: the thread (a compiled graph traces the hooks away, so one key serves it)."""
    return 0 if torch.compiler.is_compiling() else threading.get_ident()
