"""The C++ extension of the per-call path (``ext.cpp``), built on first use and cached.

An eager CPU call whose plan is simple (contiguous tensors, no per-group inputs, no
buffers passed; :class:`derivgen.torch.plan.KernelPlan`) and whose kernels' argument runs
fit the extension's calls (``MAX_LEAD``, ``MAX_OPTS``, ``MAX_TAIL``) runs through the
extension: one call checks that the tensors, options and groups fit the plan, allocates
the outputs, calls the forward kernel and, when autograd needs it, makes the autograd
node whose backward calls the backward kernel, without Python; a backward with
create_graph=True calls the backward operator instead (its autograd is the derived double
backward). A signature's first call, a different signature, options out of range,
forward AD, torch.func and torch.compile go through the Python path, which validates and
names errors (a validated first call is then run by the extension).

The extension is compiled with ``torch.utils.cpp_extension`` (a C++ compiler and ninja:
``pip install ninja``; derivgen's ``torch`` extra brings it) into derivgen's build cache
(:func:`derivgen.runtime.build.cache_dir`), keyed by its source and the versions of torch
and Python. The build says so in one line on stderr (whatever stderr is), and
:func:`derivgen.torch.build` does it ahead. Where it cannot be built, the Python path
does the same work (a note on stderr says so, once per process); ``DERIVGEN_TORCH_EXT=0``
turns it off.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from derivgen.runtime.build import announce, cache_dir

SOURCE = Path(__file__).with_name("ext.cpp")
CXXFLAGS = ["-O2"]
# what the first-use line on stderr says the build takes: 70 s measured on a 2-core Xeon
# under load (g++ 12, torch 2.13's headers), with 1.2 GB of memory
TOOK = "1-2 min"

_LOCK = threading.Lock()
_STATE: dict[str, ModuleType | None] = {}


def enabled() -> bool:
    """Whether the extension may be used (``DERIVGEN_TORCH_EXT`` is not ``0``)."""
    return os.environ.get("DERIVGEN_TORCH_EXT", "1").strip().lower() not in ("0", "false", "no", "off")


def build_name() -> str:
    """The extension's module name: its source, torch's version and Python's ABI, hashed."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(
        "\0".join([torch.__version__, sys.version, sysconfig.get_config_var("EXT_SUFFIX") or "", *CXXFLAGS]).encode()
    )
    return f"derivgen_torch_ext_{h.hexdigest()[:16]}"


def module() -> ModuleType | None:
    """The loaded extension, built on first use; None where it is turned off or cannot be
    built (with a one-line note on stderr, once)."""
    if "module" not in _STATE:
        with _LOCK:
            if "module" not in _STATE:
                _STATE["module"] = _load() if enabled() else None
    return _STATE["module"]


def _load() -> ModuleType | None:
    try:
        return _build_and_import()
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as e:
        # no compiler, no headers, no ninja, a failed build or load: the Python path
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"derivgen.torch: C++ extension unavailable ({first}); using the Python per-call path", file=sys.stderr)
        return None


def _build_and_import() -> ModuleType:
    name = build_name()
    root = cache_dir() / "torch_ext" / name
    root.mkdir(parents=True, exist_ok=True)
    lib = root / f"{name}.so"  # torch.utils.cpp_extension's name for it
    with open(root / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not lib.is_file():
                return _build(name, root)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    loader = importlib.machinery.ExtensionFileLoader(name, str(lib))
    spec = importlib.util.spec_from_file_location(name, str(lib), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _build(name: str, root: Path) -> ModuleType:
    from torch.utils import cpp_extension

    announce("derivgen.torch's C++ extension", TOOK, root)
    with _ninja_on_path():
        return cpp_extension.load(name, [str(SOURCE)], extra_cflags=CXXFLAGS, build_directory=str(root), verbose=False)


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """ninja on PATH for the build: the ``ninja`` package's (``pip install ninja``) where
    PATH has none (a virtual environment used without activating it)."""
    if shutil.which("ninja"):
        yield
        return
    where = [Path(sys.executable).parent]
    with contextlib.suppress(ImportError):
        import ninja  # type: ignore[import-not-found]

        where.insert(0, Path(ninja.BIN_DIR))
    found = next((d for d in where if (d / "ninja").is_file()), None)
    if found is None:
        yield  # cpp_extension says that ninja is missing
        return
    before = os.environ.get("PATH", "")
    os.environ["PATH"] = str(found) + os.pathsep + before
    try:
        yield
    finally:
        os.environ["PATH"] = before
