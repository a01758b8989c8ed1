"""Patch repos: share a patch the way PEFT shares adapters (repo.py)."""

from .repo import (
    PatchRepoError,
    export_full_folder,
    is_patch_repo,
    load_patch,
    push_patch,
    read_record,
    save_patch,
)

__all__ = ["PatchRepoError", "export_full_folder", "is_patch_repo", "load_patch", "push_patch", "read_record",
           "save_patch"]
