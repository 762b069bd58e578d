"""Build ahead what ``derivgen.torch`` builds on first use (:func:`build`).

A first call of a derivgen.torch module compiles the C++ extension of the per-call path
(a minute or two: :mod:`derivgen.torch.ext`) and the layer's C kernels (seconds per
layer), each announced in one line on stderr. ``build`` does the same work before a job
starts (an install step, a container image, the first cell of a notebook), so that the
first training step does not wait; both land in the build cache
(:func:`derivgen.runtime.build.cache_dir`), where later processes find them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from derivgen.runtime.build import library_path
from derivgen.spec import Spec
from derivgen.torch import ext
from derivgen.torch.ops import layer


def build(
    *layers: str | os.PathLike | Spec, extension: bool = True, extras: bool = False, second: bool = False
) -> list[Path]:
    """Compile, into the build cache, derivgen.torch's C++ extension (unless ``extension``
    is False or ``DERIVGEN_TORCH_EXT=0`` turns it off) and the C kernels of each layer
    named (a catalogue or zoo name, a spec file's path, or a Spec), with their bfloat16
    and channels-last kernels too when ``extras`` is True and their second-order kernels
    (double backward, JVP) when ``second`` is True; return the paths of the
    libraries, built now or found in the cache. What is not in the cache yet says so in
    one line on stderr while it builds. Raises RuntimeError when the extension cannot be
    built (first use would fall back to the Python per-call path), and
    :class:`derivgen.runtime.build.BuildError` when a layer's C does not compile."""
    out: list[Path] = []
    if extension and ext.enabled():
        mod = ext.module()
        if mod is None:
            raise RuntimeError(
                "derivgen.torch's C++ extension could not be built (the note above says why); "
                "its calls run the Python per-call path"
            )
        out.append(Path(mod.__file__))
    for name in layers:
        libraries = layer(name if isinstance(name, (Spec, str, Path)) else Path(name)).libraries
        kernels = [libraries.main]
        if extras:
            kernels.append(libraries.for_call(torch.bfloat16))
        for k in kernels:
            k.lib  # noqa: B018 -- compiled (or found in the cache) and loaded
            out.append(library_path(k.source, extra=k.extra, cflags=k.cflags))
        if second:
            main = libraries.main
            main.second_lib  # noqa: B018
            out.append(library_path(main.source, extra=main.second_extra, cflags=main.cflags))
    return out
