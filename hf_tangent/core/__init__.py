"""The core: what every patched folder ships as remote code. The update rules (rules.py) and their
fused / Triton forms, one layer's patch (layer.py), the architecture table and its discovery
(registry.py, discovery.py), `patch` / `unpatch` (patching.py), wrappers, and where a writer may
write (destinations.py).

Its modules import only each other and the libraries (torch, transformers): a Hub folder's remote
code is this folder's modules, copied by listing it (`destinations.core_modules`). This file is not copied,
so the modules never rely on it."""
