"""What hf_tangent writes and reads: complete patched folders (serialization.py), Hub folders with
remote code (hub.py), patch repos shared the way PEFT shares adapters (patch_repo.py) and the identity
check of their base (identity.py), the offline checkpoints (checkpoints.py), and the one loading front
that dispatches between them (loading.py; models.py loads by name).

Stands on the core; the core reaches it only through what it registers (hub.py: the config class a patched model saves with)."""
