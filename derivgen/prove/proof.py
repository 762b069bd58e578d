"""Proof of the closed forms against brute-force differentiation at small N.

For N = 2..6 the layer is written out with N explicit scalar symbols per
element-level quantity (x_j, ∂L/∂y_j and every per-channel parameter), the
statistics as explicit sums, ``L = Σ_j ∂L/∂y_j · y_j`` differentiated with
``sympy.diff``, and the difference from the closed form reduced to zero with
``together``/``cancel`` -- one coefficient of each ∂L/∂y_j at a time (both
sides are linear in ∂L/∂y), at element 0 (the layer is symmetric in its
elements), with square roots as generators t, t² = E, and absolute values
split by sign.  The reduction is exact rational arithmetic in sparse polynomials
(:mod:`derivgen.prove.exact`) under a budget counted in work -- term pairs multiplied,
:data:`SYMBOLIC_WORK` per size -- not in seconds, so the verdict depends on the spec and
the size alone. Where that does not reach zero within the budget, the difference is
evaluated at random rational points in 80-digit arithmetic, and the result is reported as
"checked numerically" -- never as "proven".

This module runs the proof (:func:`prove_mode`, :func:`prove_second_mode`) under the budget
and the guard, and holds its results; the explicit layer is :mod:`~derivgen.prove.explicit`'s,
the checks :mod:`~derivgen.prove.checks`', the symbolic reduction :mod:`~derivgen.prove.zero`'s
and the numeric check :mod:`~derivgen.prove.numeric`'s.
"""

from __future__ import annotations

import functools
import signal
import threading
import time
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from derivgen.derive.results import ModeDerivation, SecondOrder
from derivgen.prove.checks import _first_checks, _second_checks, _sized
from derivgen.prove.exact import OutOfWork, Work
from derivgen.prove.explicit import _Check, _Explicit, window_sizes
from derivgen.prove.numeric import _Sampler, _zero_numeric
from derivgen.prove.zero import _polynomial_zero, _proven, _reduces_to_zero  # noqa: F401 (the tests import them from here)

__all__ = ["ModeProof", "ProofResult", "prove_derivation", "prove_mode", "prove_second_mode", "window_sizes"]


@dataclass
class ProofResult:
    """One size's verdict: at N = ``n`` the closed forms were proven, checked numerically,
    FAILED (``detail`` says which check) or "timed out" (past the last-resort guard of
    :data:`GUARD_SECONDS`, which no budget of work decides), by ``method``, in ``seconds``."""

    n: int
    status: str  # "proven", "checked numerically", "FAILED", "timed out"
    method: str
    seconds: float
    detail: str = ""
    work: int = 0  # units of exact arithmetic the symbolic reduction used (the same on every machine)

    @property
    def ok(self) -> bool:
        """Proven or checked numerically: not failed."""
        return self.status in ("proven", "checked numerically")


@dataclass
class ModeProof:
    """One mode's proof: a :class:`ProofResult` per size."""

    mode: str
    results: list[ProofResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No size failed."""
        return all(r.ok for r in self.results)

    @property
    def status(self) -> str:
        """The weakest result over the sizes: "FAILED", "timed out", "checked numerically",
        "proven", or "not checked" when there are none."""
        if not self.results:
            return "not checked"
        if any(r.status == "FAILED" for r in self.results):
            return "FAILED"
        if not self.ok:
            return "timed out"
        if all(r.status == "proven" for r in self.results):
            return "proven"
        return "checked numerically"


# per size: the exact arithmetic the symbolic reduction may do (units of exact.Work: term pairs
# multiplied) before the rest of that size's checks fall back to 80-digit numbers. A count of
# work, not seconds, so the verdict is the same on every machine and under any load.
SYMBOLIC_WORK = 20_000_000
# per size: a last guard in seconds against a SymPy step that no budget counts (differentiation
# of the unrolled forward); a size that reaches it is reported "timed out", never downgraded
GUARD_SECONDS = 3600.0


class _OutOfTime(Exception):
    pass


@contextmanager
def _budget(seconds: float):
    """Raise _OutOfTime in the block after ``seconds`` (main thread only: SIGALRM); an
    outer alarm (the spec fuzzer's) is kept and restored."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return
    outer_left, _ = signal.getitimer(signal.ITIMER_REAL)
    if outer_left and outer_left <= seconds:
        yield  # the outer alarm comes first anyway
        return
    t0 = time.monotonic()

    def fire(signum, frame):
        # again in 50 ms: an exception raised while a gc callback runs (hypothesis installs
        # one) is printed and dropped there, and the block would run on unbounded
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        raise _OutOfTime()

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer_left:
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, outer_left - (time.monotonic() - t0)))


def prove_mode(first: ModeDerivation, sizes: Iterable[int] = (2, 3, 4, 5, 6), work: int | None = None) -> ModeProof:
    """One mode's first-order closed forms against brute-force differentiation at each size
    (symbolic within ``work`` units of exact arithmetic per size, :data:`SYMBOLIC_WORK` by
    default, then 80-digit numbers)."""
    out = ModeProof(first.mode)
    points = _Sampler.for_spec(first.spec, 1234)
    limit = SYMBOLIC_WORK if work is None else work

    def settle(n, t0):
        checks = []
        for k in window_sizes(first.spec):
            ex = _Explicit(first, n, k)
            lin = [c for cs in ex.cotangents for c in cs]
            checks += [(_sized(what, k), d, lin) for what, d in _first_checks(first, ex)]
        return _settle(n, checks, t0, points, limit)

    for n in sizes:
        out.results.append(_guarded(n, functools.partial(settle, n)))
    return out


def _settle(n: int, checks: list[_Check], t0: float, points: _Sampler, work_limit: int | None) -> ProofResult:
    """One size's result: each (what, difference, symbols it is linear in) reduced to zero
    symbolically (one coefficient of those symbols at a time) while the size's budget of
    ``work_limit`` units of exact arithmetic lasts, then in 80-digit arithmetic at random
    rational points; the first that is not zero fails."""
    method, status, detail = METHOD, "proven", ""
    work = Work(work_limit)
    for what, d, lin in checks:
        if not work.spent:
            try:
                if _proven(d, lin, work):
                    continue
            except OutOfWork:
                pass  # spent: 80-digit numbers for this check and the rest
        if _zero_numeric(d, points):
            method, status = "80-digit arithmetic at random rational points", "checked numerically"
            continue
        status, detail = "FAILED", f"{what} differs from brute force"
        break
    return ProofResult(n, status, method, time.perf_counter() - t0, detail, work.used)


METHOD = "exact rational arithmetic"


def _guarded(n: int, settle) -> ProofResult:
    """``settle()`` for size n, or "timed out" after :data:`GUARD_SECONDS`."""
    t0 = time.perf_counter()
    try:
        with _budget(GUARD_SECONDS):
            return settle(t0)
    except _OutOfTime:
        return ProofResult(n, "timed out", METHOD, time.perf_counter() - t0, f"past the {GUARD_SECONDS:g} s guard")


class _Derived(Protocol):
    """What :func:`prove_derivation` reads of a derivation: its modes."""

    modes: Mapping[str, ModeDerivation]


def prove_derivation(derivation: _Derived, sizes: Iterable[int] = (2, 3, 4, 5, 6)) -> dict[str, ModeProof]:
    """Every mode of a derivation (anything with ``modes``) proven: mode name -> proof."""
    return {name: prove_mode(first, sizes) for name, first in derivation.modes.items()}


def prove_second_mode(second: SecondOrder, sizes: Iterable[int] = (2, 3, 4, 5), work: int | None = None) -> ModeProof:
    """The second-order closed forms (:mod:`derivgen.derive.second`) against brute force at small N:
    the first-order gradients of the explicit layer by ``sympy.diff``, their VJP with the
    cotangents (δx, δp, δi) differentiated again, and the directional derivative of the
    explicit y along (ẋ, ṗ, i̇); for a layer with tensor inputs and outputs beside y, δt and ṫ
    of each tensor with a gradient, the gradients of L₂ w.r.t. each tensor and each output's
    cotangent, and the tangent of each output; compared at element 0 like the first order, one
    coefficient of each cotangent or tangent at a time (both sides are linear in them).
    Falls back to 80-digit evaluation at random rational points when the symbolic budget
    (``work`` units of exact arithmetic per size, :data:`SYMBOLIC_WORK` by default) is spent
    (reported as "checked numerically")."""
    out = ModeProof(second.first.mode)
    points = _Sampler.for_spec(second.spec, 4321)
    limit = SYMBOLIC_WORK if work is None else work
    for n in sizes:
        out.results.append(_guarded(n, lambda t0, n=n: _settle(n, _second_checks(second, n), t0, points, limit)))
    return out
