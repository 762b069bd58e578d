"""Programmatic entry points: ``names()``, ``load_spec()``, ``derive()`` (a frozen :class:`Derivation`)
and ``load()`` (a layer's generated NumPy, C or PyTorch module, from the cache)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType

import jinja2
import sympy

from derivgen.codegen import targets
from derivgen.codegen.emit import emit, template_dir
from derivgen.derive.first import ModeDerivation, derive_mode
from derivgen.derive.second import SecondOrder, derive_second
from derivgen.explain import document
from derivgen.explain.steps import Step, build_steps, facts
from derivgen.prove.proof import ModeProof, prove_derivation, prove_second_mode
from derivgen.runtime.build import cache_dir
from derivgen.runtime.fsutil import atomic_write
from derivgen.spec import Spec, catalogue_names, load_catalogue, load_spec_file, zoo_names
from derivgen.symbolic import functions

_TRAIN_MODE_FIELDS = ("dx", "dparams", "dinputs", "reductions", "g")


@dataclass(frozen=True)
class Derivation:
    """Everything derivgen knows about one layer: per-mode derivations and proofs.

    The first order of each mode is computed up front (``modes``); its second order
    (:meth:`second`), its steps for people (:meth:`steps_of`) and the proofs of the second
    order are computed on first use and kept."""

    spec: Spec
    modes: dict[str, ModeDerivation]
    proofs: dict[str, ModeProof] = field(default_factory=dict)
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def name(self) -> str:
        """The layer's name."""
        return self.spec.name

    @property
    def train(self) -> ModeDerivation:
        """The training mode's derivation."""
        return self.modes["train"]

    def __getattr__(self, item: str) -> object:
        # convenience: d.dx, d.dparams ... refer to the first (training) mode
        if item in _TRAIN_MODE_FIELDS:
            return getattr(self.modes["train"], item)
        raise AttributeError(item)

    def _cached(self, key: tuple, compute: Callable[[], object]) -> object:
        """``compute()``, computed once per ``key`` and kept."""
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def memo(self, key: tuple, compute: Callable[[], object]) -> object:
        """What a later stage computes from this derivation alone (code generation's IR and
        kernel plans), computed once per ``key`` and kept with it: a layer emitted for
        several targets is planned once."""
        return self._cached(("memo", *key), compute)

    def _mode(self, mode: str) -> ModeDerivation:
        """One mode's derivation; a ValueError naming the layer's modes for another."""
        if mode not in self.modes:
            raise ValueError(f"{self.spec.name}: mode must be one of {list(self.modes)}, got {mode!r}")
        return self.modes[mode]

    def second(self, mode: str = "train") -> SecondOrder:
        """The second order (double backward, JVP) of one mode."""
        first = self._mode(mode)
        return self._cached(("second", mode), lambda: derive_second(first))

    def steps_of(self, mode: str = "train") -> tuple[Step, ...]:
        """The derivation of one mode as steps for people."""
        first = self._mode(mode)
        return self._cached(("steps", mode), lambda: build_steps(first))

    def second_proof(self, mode: str, sizes: tuple[int, ...]) -> ModeProof:
        """The second order of one mode against brute force at the sizes ``sizes``."""
        sizes = proof_sizes(sizes, "sizes")
        return self._cached(("second proof", mode, sizes), lambda: prove_second_mode(self.second(mode), sizes))

    @property
    def steps(self) -> tuple[Step, ...]:
        """The training mode's steps."""
        return self.steps_of("train")

    @property
    def vanishing(self) -> list[tuple[str, str]]:
        """The training mode's exactly-zero terms, (what, why), as text."""
        return facts(self.train)[0]

    @property
    def kept(self) -> list[tuple[str, str]]:
        """The training mode's terms that look like they vanish but do not, (what, why)."""
        return facts(self.train)[1]

    def render(
        self, fmt: str = "latex", standalone: bool = False, order: int = 1, second_sizes: Iterable[int] = (2, 3, 4, 5)
    ) -> str:
        """The derivation for people in LaTeX, Markdown or text; ``order=2`` adds the second
        order, proven at ``second_sizes`` (a tuple of sizes; True: 2..5; False, None or (): not
        proven)."""
        document.check_format(fmt)
        if order not in (1, 2):
            raise ValueError(f"order must be 1 or 2, got {order!r}")
        if second_sizes is True:  # as derive(prove=True): the default sizes; False or None: not proven
            second_sizes = (2, 3, 4, 5)
        elif second_sizes is False or second_sizes is None:
            second_sizes = ()
        sizes = proof_sizes(second_sizes, "second_sizes", allow_none=True)
        modes = [
            document.ModeDocument(
                self.modes[mode],
                self.steps_of(mode),
                self.proofs.get(mode),
                self.second(mode) if order >= 2 else None,
                self.second_proof(mode, sizes) if order >= 2 and sizes else None,
            )
            for mode in self.modes
        ]
        return document.render(self.spec, modes, fmt, standalone)

    def _repr_markdown_(self) -> str:
        """The derivation in Markdown, for a notebook (Jupyter shows it with its mathematics)."""
        return self.render("markdown")

    def _repr_latex_(self) -> str:
        """Each mode's closed forms as one display-math block, for a notebook."""
        return (
            "$$" + document.closed_forms_latex(self.spec, {m: self.steps_of(m) for m in self.modes}, self.modes) + "$$"
        )


def names() -> list[str]:
    """The built-in catalogue, sorted."""
    return catalogue_names()


def zoo() -> list[str]:
    """The zoo: published layers written as specs, sorted (load any by name)."""
    return zoo_names()


def load_spec(name_or_path: str | Path) -> Spec:
    """A catalogue or zoo name, or a path to a spec file (anything containing '/' or ending in .toml)."""
    text = str(name_or_path)
    if isinstance(name_or_path, Path) or text.endswith(".toml") or "/" in text:
        return load_spec_file(text)
    return load_catalogue(text)


@functools.lru_cache(maxsize=64)
def _derive_spec(spec: Spec, prove: tuple[int, ...]) -> Derivation:
    """Derive every mode of ``spec`` and, when ``prove`` names sizes, prove them (memoized)."""
    if not prove:
        return Derivation(spec, {m.name: derive_mode(spec, m.name) for m in spec.modes})
    derivation = _derive_spec(spec, ())
    proven = replace(derivation, proofs=prove_derivation(derivation, prove))
    # the same derivation with its proofs: what either computes on first use (the second
    # order, steps, plans) does not depend on the proofs, so they keep it in one place
    object.__setattr__(proven, "_cache", derivation._cache)
    return proven


def derive(name_or_spec: str | Path | Spec, *, prove: bool | tuple[int, ...] = False) -> Derivation:
    """Derive the backward pass of a catalogue layer, a spec file or a Spec.

    ``prove=True`` also checks the closed forms against brute-force
    differentiation at N = 2..6 (or pass the tuple of sizes).
    """
    spec = name_or_spec if isinstance(name_or_spec, Spec) else load_spec(name_or_spec)
    if prove is True:
        sizes: tuple[int, ...] = tuple(range(2, 7))
    elif prove is False or prove is None:
        sizes = ()
    else:
        sizes = proof_sizes(prove, "prove", allow_none=True)  # () proves nothing, as False
    return _derive_spec(spec, sizes)


MAX_PROOF_SIZE = 12  # the largest group the brute-force proof unrolls


def proof_sizes(sizes: object, arg: str, allow_none: bool = False) -> tuple[int, ...]:
    """``sizes`` as a tuple of proof sizes, each an int in 2..12 (the error names ``arg``);
    empty only with ``allow_none``."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"{arg} must be True, False or a tuple of sizes like (2, 3), got {sizes!r}")
    out = tuple(sizes)
    if not out and not allow_none:
        raise ValueError(f"{arg}: no proof size given (False proves nothing)")
    bad = [n for n in out if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= MAX_PROOF_SIZE]
    if bad:
        raise ValueError(f"{arg}: proof sizes must be ints in 2..{MAX_PROOF_SIZE}, got {bad[0]!r}")
    return out


_LOADED: dict[tuple, ModuleType] = {}  # (backend, digest, cflags) and (spec, backend, cflags) -> module


def load(name_or_spec: str | Path | Spec, backend: str = "numpy", *, cflags: list[str] | None = None) -> ModuleType:
    """Import a layer's generated module: ``forward``/``backward`` over NumPy or C
    (or, ``backend="torch"``, the same functions on torch tensors on any device, as the
    closed forms in PyTorch operations; see docs/devices.md; ``backend="triton"``: the
    generated Triton kernels on torch tensors, see docs/triton.md).

    The code is generated from the spec into the derivgen cache directory (so
    it works from an installed package too) and imported from there; the C
    backend compiles its kernels there on first use, with ``$CFLAGS`` (or the
    defaults), or with ``cflags`` when given: each set of flags is a module of
    its own, so builds for several instruction sets can run side by side
    (``derivgen.runtime.build.march_cflags("x86-64-v3")``).
    """
    loadable = list(targets.names(loadable=True))
    if backend not in loadable:
        raise ValueError(f"backend must be {targets.one_of(loadable)}, got {backend!r}")
    target = targets.get(backend)
    if cflags is not None and not target.cflags:
        raise ValueError(
            f"cflags= applies to the {' and '.join(t.label for t in targets.TARGETS.values() if t.cflags)} backend only"
        )
    spec = name_or_spec if isinstance(name_or_spec, Spec) else load_spec(name_or_spec)
    flags = None if cflags is None else tuple(str(f) for f in cflags)
    if (spec, backend, flags) in _LOADED:  # the same spec: no need to derive and render again
        return _LOADED[(spec, backend, flags)]
    root, digest = materialize(spec, backend)
    key = (backend, digest, flags)
    if key in _LOADED:
        _LOADED[(spec, backend, flags)] = _LOADED[key]
        return _LOADED[key]
    tag = "" if flags is None else "_" + hashlib.sha256("\0".join(flags).encode()).hexdigest()[:8]
    modname = f"derivgen_generated_{backend}_{spec.name}_{digest}{tag}"
    module_spec = importlib.util.spec_from_file_location(modname, root / target.module.format(name=spec.name))
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[modname] = module
    module_spec.loader.exec_module(module)
    if target.after_load is not None:  # the Triton module's second order runs the spec's PyTorch closed forms
        target.after_load(module, spec)
    if flags is not None:
        module._kernel.cflags = list(flags)  # built on first use, so before any call
    _LOADED[key] = _LOADED[(spec, backend, flags)] = module
    return module


def _files_digest(files: dict[str, str]) -> str:
    return hashlib.sha256("\0".join(f"{k}\0{v}" for k, v in sorted(files.items())).encode()).hexdigest()[:16]


def materialize(spec: Spec, backend: str) -> tuple[Path, str]:
    """Write the generated code of one backend into the cache; (directory, content digest).

    What a spec generates is remembered on disk (``modules/index/``) under a key of the spec,
    the target and derivgen's own source (:func:`_generation_key`), so a later process loads
    the files without deriving again (SwitchNorm's derivation takes half a minute); the files
    are read back and must give the recorded digest, else they are generated again."""
    key = _generation_key(spec, backend)
    index = cache_dir() / "modules" / "index" / f"{key}.json" if key else None
    if index is not None and index.is_file():
        try:
            entry = json.loads(index.read_text(encoding="utf-8"))
            root = cache_dir() / "modules" / f"{spec.name}-{backend}-{entry['digest']}"
            files = {rel: (root / Path(rel).name).read_text(encoding="utf-8") for rel in entry["files"]}
            if _files_digest(files) == entry["digest"]:
                return root, entry["digest"]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable or partial: generate again
    files = emit(derive(spec), targets=(backend,)).files
    digest = _files_digest(files)
    root = cache_dir() / "modules" / f"{spec.name}-{backend}-{digest}"
    for rel, text in files.items():
        path = root / Path(rel).name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            atomic_write(path, text)
    if index is not None:
        atomic_write(index, json.dumps({"digest": digest, "files": sorted(files)}))
    return root, digest


# the function table and the targets as derivgen defines them: a process that registers a
# function or target of its own (a test, a user's extension) generates without the disk index
_BUILTIN_TABLES = (dict(functions.TABLE), dict(targets.TARGETS))


def _pristine() -> bool:
    return all(
        len(now) == len(then) and all(now.get(k) is v for k, v in then.items())
        for now, then in zip((functions.TABLE, targets.TARGETS), _BUILTIN_TABLES)
    )


def _canonical(v: object) -> str:
    """A spec (or any part of one) as text that is the same in every process: dataclasses by
    field, sets sorted, SymPy expressions by ``srepr``."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        fields = ",".join(f"{f.name}={_canonical(getattr(v, f.name))}" for f in dataclasses.fields(v))
        return f"{type(v).__name__}({fields})"
    if isinstance(v, (set, frozenset)):
        return "{" + ",".join(sorted(_canonical(e) for e in v)) + "}"
    if isinstance(v, dict):
        return "{" + ",".join(f"{_canonical(k)}:{_canonical(e)}" for k, e in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "(" + ",".join(_canonical(e) for e in v) + ")"
    if isinstance(v, sympy.Basic):
        return sympy.srepr(v)
    return repr(v)


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """Every file of the derivgen package and of its templates, and the versions of Python,
    SymPy and Jinja: what the generated code depends on besides the spec."""
    h = hashlib.sha256(f"{sys.version}\0{sympy.__version__}\0{jinja2.__version__}".encode())
    for folder in (Path(__file__).resolve().parent, template_dir()):
        for path in sorted(folder.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                h.update(f"\0{path.relative_to(folder).as_posix()}\0".encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def _generation_key(spec: Spec, backend: str) -> str | None:
    """The disk index's key of what ``spec`` generates for ``backend`` (None: not indexed,
    where the function table or the targets are not derivgen's own)."""
    if not _pristine():
        return None
    text = f"{_source_digest()}\0{backend}\0{_canonical(spec)}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]
