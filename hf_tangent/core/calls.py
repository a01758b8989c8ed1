"""Per-thread keys: what one hook hands the next is stored under the calling thread's key, so two
threads running one model never see each other's tensors."""

from __future__ import annotations

import threading

import torch

_ident = threading.get_ident


@torch.compiler.assume_constant_result  # a compiled graph traces the hand-over away: one constant key serves it
def call_key() -> int:
    return _ident()
