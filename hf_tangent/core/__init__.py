"""The core: the update rules (rules.py) and their fused / Triton forms, one layer's patch (layer.py), the
architecture table (registry.py) and its discovery (discovery.py), a patch put on and taken off (install.py),
the public operations (patching.py), wrappers, and where a writer may write (destinations.py).

A patched folder ships part of it as remote code (`destinations.REMOTE_CODE_MODULES`: what a patched forward
needs). The modules it does not ship (patching, options, discovery, destinations, gather, rules, triton_update,
fused_parallel) reach the shipped ones here, by registration: this file is not copied, so in remote code the
shipped modules run without them."""

from . import destinations, discovery, fused_parallel, install, layer, rules

install.register_package(checked_spec=discovery.checked_spec, verify=discovery.verify_patch,
                          atomic_save=destinations.AtomicSave)


def _triton_kernel():
    from .triton_update import triton_residual_delta  # imports triton: only when implementation="triton" is used

    return triton_residual_delta


layer.register_kernel("triton", _triton_kernel)
layer.register_kernel("reference", lambda: rules.residual_delta)  # plain tensor ops: the package's reference
layer.register_kernel("fused_parallel", lambda: fused_parallel.FusedParallelExecution)
