"""Fault injection for the writers' crash-consistency tests (tests/test_crash_consistency.py).

`Steps` replaces every filesystem primitive a writer uses with one that counts its calls (the
steps) and, at step N, raises an OSError (a `shutil.rmtree(ignore_errors=True)` removes nothing
instead, which is how that call fails), or kills the process with SIGKILL before or after doing
the step. `kill_at` runs a writer in a forked child under `Steps(kill=N)` so the parent
(the test) sees what a kill at that step leaves.

The primitives: os.mkdir (Path.mkdir, os.makedirs), os.rename, os.replace, os.rmdir, os.unlink,
os.remove, os.chmod, shutil.rmtree, shutil.copy2, a file opened for writing (builtins.open,
io.open: Path.write_text / write_bytes, json and torch writers), and safetensors' save_file (which
writes from Rust, as transformers' and PEFT's saves do).
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import shutil
import signal
import sys

_WRITE_MODES = set("wax+")


def _targets():
    """(module, attribute) of every primitive counted as a step."""
    found = [(os, name) for name in ("mkdir", "rename", "replace", "rmdir", "unlink", "remove", "chmod")]
    found += [(shutil, "rmtree"), (shutil, "copy2"), (builtins, "open"), (io, "open")]
    for module, name in (("safetensors.torch", "save_file"), ("transformers.modeling_utils", "safe_save_file"),
                         ("peft.peft_model", "safe_save_file"), ("peft.utils.save_and_load", "safe_save_file")):
        if module in sys.modules and hasattr(sys.modules[module], name):
            found.append((sys.modules[module], name))
    return found


class Steps:
    """Counts the filesystem steps inside `with Steps(...)`; `fail` (1-based) raises OSError at that
    step, `kill` kills the process there ("before": the step is not done, "after": it is)."""

    def __init__(self, *, fail: int | None = None, kill: int | None = None, when: str = "before"):
        self.fail, self.kill, self.when = fail, kill, when
        self.log: list[str] = []
        self._saved = []

    def _wrap(self, name, real):
        def step(*args, **kwargs):
            if name == "open":
                mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
                if not isinstance(mode, str) or not (_WRITE_MODES & set(mode)):
                    return real(*args, **kwargs)
            self.log.append(f"{name}({os.fspath(args[0]) if args and isinstance(args[0], (str, os.PathLike)) else ''})")
            n = len(self.log)
            if n == self.fail:
                if name == "rmtree" and kwargs.get("ignore_errors"):  # what such a call does when it fails
                    return None
                raise OSError(f"injected failure at step {n}: {self.log[-1]}")
            if n == self.kill and self.when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                return real(*args, **kwargs)
            finally:  # "after": the step done (an open file: created empty, nothing written), or failed
                if n == self.kill and self.when == "after":
                    os.kill(os.getpid(), signal.SIGKILL)

        return step

    def __enter__(self):
        for module, name in _targets():
            real = getattr(module, name)
            self._saved.append((module, name, real))
            setattr(module, name, self._wrap(name if name != "safe_save_file" else "save_file", real))
        return self

    def __exit__(self, *exc):
        for module, name, real in reversed(self._saved):
            setattr(module, name, real)
        self._saved.clear()


def count_steps(write) -> list[str]:
    """The steps `write()` takes, in order."""
    with Steps() as steps:
        write()
    return steps.log


def kill_at(write, step: int, when: str = "before") -> str:
    """Run `write()` in a forked child killed at `step`: "killed", or "finished" when it has fewer steps."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test
        code = 0
        try:
            with contextlib.redirect_stderr(io.StringIO()), Steps(kill=step, when=when):
                write()
        except BaseException:  # noqa: BLE001
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed"
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return "finished"
    raise AssertionError(f"the writer failed in the child at step {step} ({when}) instead of being killed: {status}")
