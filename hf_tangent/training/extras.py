"""The `recipes` extra (pyproject.toml): datasets, gguf, rdata, evaluate, matplotlib. Patching, saving and
loading need none of them; a recipe imports what it needs where it needs it, inside `needs_recipes`."""

from __future__ import annotations

import contextlib

INSTALL = "pip install 'hf_tangent[recipes]'"


class MissingExtraError(ImportError, RuntimeError):
    """An optional package is not installed. A RuntimeError too, so that the command line reports it in one
    `hf-tangent <command>: error: ...` line."""


@contextlib.contextmanager
def needs_recipes(feature: str):
    """Wraps the import of an optional package: one that is not installed raises one error that names the
    feature, the package and the extra that installs it."""
    try:
        yield
    except ModuleNotFoundError as err:
        raise MissingExtraError(f"hf_tangent: {feature} needs the `recipes` extra ({err.name} is not installed): "
                                f"{INSTALL}", name=err.name) from err
