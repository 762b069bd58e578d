"""Derivations for people: LaTeX, Markdown and plain text.

Two small printers over SymPy's own: spec symbols print with their display
names (μ, σ², x̂, γ ...), element-level symbols carry the subscript i outside
a group mean, and ``Mean(e)`` prints as ⟨e⟩ (LaTeX) or mean(e) (text).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass

import sympy
from sympy.printing.latex import LatexPrinter
from sympy.printing.str import StrPrinter

from derivgen.derive.first import ModeDerivation
from derivgen.derive.second import SecondOrder
from derivgen.prove.proof import ModeProof
from derivgen.spec.model import _GREEK, Named, Spec
from derivgen.symbolic import functions
from derivgen.symbolic.functions import SpellsFunctions, call
from derivgen.symbolic.naming import DisplayNames, TextSpelling, _Ordered
from derivgen.symbolic.reduce import Mean


class _Equal(sympy.Function):
    """Display only: indicator(t)·indicator(-t), the mask of t = 0 (the elements that attain a
    group maximum), printed [u = v] for t = u - v."""

    nargs = 1


def _equalities(expr: sympy.Expr) -> sympy.Expr:
    """``expr`` with every product indicator(t)·indicator(-t) written as :class:`_Equal` (t)."""
    if not isinstance(expr, sympy.Basic) or not expr.has(functions.Indicator):
        return expr

    def pair(m: sympy.Mul) -> sympy.Expr:
        inds = [f for f in m.args if isinstance(f, functions.Indicator)]
        used: set[int] = set()
        out = []
        for i, a in enumerate(inds):
            if i in used:
                continue
            j = next(
                (
                    j
                    for j in range(i + 1, len(inds))
                    if j not in used and sympy.expand(inds[j].args[0] + a.args[0]) == 0
                ),
                None,
            )
            if j is not None:
                used |= {i, j}
                out.append(_Equal(a.args[0]))
        if not used:
            return m
        rest = [f for f in m.args if not (isinstance(f, functions.Indicator) and inds.index(f) in used)]
        return sympy.Mul(*rest, *out, evaluate=False) if out else m

    return expr.replace(lambda e: e.is_Mul and e.has(functions.Indicator), pair)


def _sides(t: sympy.Expr, element: set[str]) -> tuple[sympy.Expr, sympy.Expr]:
    """t = u - v: (u, v), the terms of t without and with a minus sign, the side with element
    values (``element``: their names) first: [|x| = m], not [m = |x|]."""
    terms = sympy.Add.make_args(t)
    u = sympy.Add(*[a for a in terms if not a.could_extract_minus_sign()])
    v = sympy.Add(*[-a for a in terms if a.could_extract_minus_sign()])

    def has_element(e: sympy.Expr) -> bool:
        return any(s.name in element for s in e.free_symbols)

    return (v, u) if has_element(v) and not has_element(u) else (u, v)


class DerivLatexPrinter(SpellsFunctions, _Ordered, LatexPrinter):
    """SymPy's LaTeX printer with the layer's display names: an element-level symbol carries
    the subscript i outside a group mean (``subscript``), ∂L/∂y prints as a fraction, and
    ``Mean(e)`` as ⟨e⟩."""

    def __init__(self, names: DisplayNames, subscript: bool = True, scalars: frozenset[str] = frozenset()):
        super().__init__({"mul_symbol": None, "fold_short_frac": False})
        self.names = names
        self.subscript = subscript
        self.scalars = scalars  # scalar parameters: one value, no element subscript
        self._depth = 0

    def _print_Symbol(self, expr, style="plain"):
        n = expr.name
        base = self.names.latex.get(n)
        if base is None:
            return super()._print_Symbol(expr)
        indexed = n in self.names.indexed or n in self.scalars
        if n in self.names.element and not indexed and self.subscript and self._depth == 0:
            if n == "dy":
                return r"\frac{\partial L}{\partial y_i}"
            return f"{{{base}}}_i" if not base.endswith("}") or "\\" in base else base + "_i"
        return base

    def _print_Mean(self, expr):
        self._depth += 1
        try:
            inner = self._print(expr.args[0])
        finally:
            self._depth -= 1
        return rf"\left\langle {inner} \right\rangle"

    def _print_GroupMax(self, expr):
        self._depth += 1
        try:
            inner = self._print(expr.args[0])
        finally:
            self._depth -= 1
        return rf"\max_{{j}} {inner}"

    def _print_GroupMin(self, expr):
        self._depth += 1
        try:
            inner = self._print(expr.args[0])
        finally:
            self._depth -= 1
        return rf"\min_{{j}} {inner}"

    def _print_elementary(self, fn: functions.Elementary, expr: sympy.Expr, exp: str | None = None) -> str:
        """The entry's LaTeX: ``\\op^{exp}{\\left(u \\right)}``, or its template (then ``^{exp}``)."""
        args = [self._print(a) for a in expr.args]
        arg = ", ".join(args)
        if "{0}" in fn.latex:
            tex = fn.latex.format(*args)
            return tex if exp is None else rf"{tex}^{{{exp}}}"
        power = "" if exp is None else f"^{{{exp}}}"
        return rf"{fn.latex}{power}{{\left({arg} \right)}}"

    def _print_Pow(self, expr):
        root = functions.half_power_sign(expr)
        if not root:
            return super()._print_Pow(expr)
        tex = call(functions.half_power().latex, self._print(expr.base))
        return tex if root > 0 else rf"\frac{{1}}{{{tex}}}"

    def _print__Equal(self, expr):
        u, v = _sides(expr.args[0], self.names.element)
        return rf"\left[{self._print(u)} = {self._print(v)}\right]"

    def _print_Window(self, expr):
        self._depth += 1
        try:
            inner, k = self._print(expr.body), self._print(expr.size)
        finally:
            self._depth -= 1
        name = r"\operatorname{window}^{\top}" if expr.transposed else r"\operatorname{window}"
        return rf"{name}_{{{k}}}\left({inner} \right)"


class DerivTextPrinter(TextSpelling, _Ordered, StrPrinter):
    """SymPy's text printer with the layer's display names (μ, σ², x̂ ...); ``Mean(e)`` prints
    as mean(e)."""

    def __init__(self, names: DisplayNames):
        super().__init__({"order": None})
        self.names = names

    def _print_Symbol(self, expr):
        return self.names.text.get(expr.name, expr.name)

    def _print_Mean(self, expr):
        return f"mean({self._print(expr.args[0])})"

    def _print_Pi(self, expr):
        return "π"

    def _print__Equal(self, expr):
        u, v = _sides(expr.args[0], self.names.element)
        return f"[{self._print(u)} = {self._print(v)}]"

    def _print_Window(self, expr):
        name = "windowᵀ" if expr.transposed else "window"
        return f"{name}({self._print(expr.body)}, {self._print(expr.size)})"

    def _print_elementary(self, fn: functions.Elementary, expr: sympy.Expr) -> str:
        if fn.name == "abs":  # |u|, as people write it
            return f"|{self._print(expr.args[0])}|"
        return super()._print_elementary(fn, expr)


class _Written(sympy.Symbol):
    """A constant as the spec wrote it (``1.2533141373155003``, ``sqrt(1.5707963267948966)``),
    standing in for its exact value when an expression is printed."""

    @classmethod
    def class_key(cls) -> tuple:
        return (1, 0, "Number")  # ordered as a number: first in a product

    def _sympystr(self, printer: object) -> str:
        return self.name

    def _latex(self, printer: object) -> str:
        if self.name.startswith("sqrt("):
            return rf"\sqrt{{{self.name[5:-1]}}}"
        return self.name


def _terminating(r: sympy.Rational) -> bool:
    """Whether ``r`` is a terminating decimal (its denominator has no prime but 2 and 5)."""
    q = r.q
    for f in (2, 5):
        while q % f == 0:
            q //= f
    return q == 1


def _long(r: sympy.Rational) -> bool:
    """A terminating decimal a person wrote as a decimal: seven or more significant digits, or
    a denominator of 1000 or more (0.044715 rather than 8943/200000; 0.1 stays 1/10)."""
    if r.is_Integer or not _terminating(r):
        return False
    return r.q >= 1000 or len(_decimal_text(abs(r)).replace(".", "").strip("0")) >= 7


def _decimals(expr: sympy.Expr) -> sympy.Expr:
    """``expr`` with its long decimal constants as the spec wrote them: 1.2533141373155003,
    held exactly as 12533141373155003/10**16, and sqrt(1.5707963267948966), which SymPy holds
    as 7·sqrt(320570678937734)/10**8, print as written rather than as ratios of huge
    integers. Only for printing: the values are exact."""
    if not isinstance(expr, sympy.Basic):
        return expr
    reps: dict = {}
    for m in expr.atoms(sympy.Mul):  # c·sqrt(k) = ±sqrt(c²·k)
        c, rest = m.as_coeff_Mul()
        roots = [
            f
            for f in sympy.Mul.make_args(rest)
            if f.is_Pow and f.base.is_Integer and f.exp == sympy.S.Half and f.base > 10**6
        ]
        if len(roots) != 1 or not c.is_Rational:
            continue
        square = c**2 * roots[0].base
        others = [f for f in sympy.Mul.make_args(rest) if f is not roots[0]]
        sign = -1 if c < 0 else 1
        if _long(square):
            reps[m] = sympy.Mul(sign, _Written(f"sqrt({_decimal_text(square)})", positive=True), *others)
        elif _long(1 / square):  # c·sqrt(k) = 1/sqrt(1/(c²·k))
            root = _Written(f"sqrt({_decimal_text(1 / square)})", positive=True)
            reps[m] = sympy.Mul(sign, sympy.Pow(root, -1), *others)
    out = expr.xreplace(reps) if reps else expr
    reps = {}
    for r in out.atoms(sympy.Rational):
        if _long(r):
            sym = _Written(_decimal_text(abs(r)), positive=True)
            reps[r] = sym if r > 0 else -sym
        elif r != 0 and _long(1 / r):  # a division by a decimal: 1/1.2533141373155003
            sym = sympy.Pow(_Written(_decimal_text(abs(1 / r)), positive=True), -1)
            reps[r] = sym if r > 0 else -sym
    return out.xreplace(reps) if reps else out


def _decimal_text(r: sympy.Rational) -> str:
    """A positive terminating decimal's digits: the shortest float spelling where it is exact,
    otherwise every digit."""
    short = repr(float(r))
    if "e" not in short and sympy.Rational(short) == r:
        return short
    digits = 0
    while (r * 10**digits).q != 1:
        digits += 1
    whole, frac = divmod(int(r * 10**digits), 10**digits)
    return f"{whole}.{frac:0{digits}d}"


def latex_expr(
    expr: sympy.Expr, spec: Spec | None = None, subscript: bool = True, extra: Mapping[str, Named] | None = None
) -> str:
    """``expr`` in LaTeX with the display names of ``spec`` and of ``extra`` (auxiliaries,
    the coordinate); element-level symbols subscripted with i unless ``subscript`` is False."""
    scalars = frozenset(p.name for p in spec.params if p.scalar) if spec is not None else frozenset()
    return DerivLatexPrinter(_shown(spec, extra), subscript, scalars).doprint(_equalities(_decimals(expr)))


class ShownAs(Named):
    """A display name in ``extra`` that overrides the spec's own (extra names otherwise only
    add): the second order writes the gradient arriving at an output as ∂L/∂h, where the
    first order's δh would read as one of its seeds."""


def _shown(spec: Spec | None, extra: Mapping[str, Named] | None) -> DisplayNames:
    """The display names of a derivation: the spec's, with an option whose default display
    abbreviates its name (momentum: m, defined nowhere in the derivation) shown by its name
    as the user passes it; the Greek letters (eps: ε) and a spec's own ``text`` stay."""
    names = DisplayNames(spec, extra)
    for n, item in (extra or {}).items():
        if isinstance(item, ShownAs):
            names.text[n], names.latex[n] = item.text, item.latex
    for o in spec.options if spec is not None else ():
        if (o.latex, o.text) == _GREEK.get(o.name) and o.text.isascii() and o.text != o.name:
            names.text[o.name] = o.name
            names.latex[o.name] = "\\mathrm{" + o.name.replace("_", "\\_") + "}"
    return names


def text_expr(expr: sympy.Expr, spec: Spec | None = None, extra: Mapping[str, Named] | None = None) -> str:
    """``expr`` in text with the display names of ``spec`` and ``extra``: ^ for powers, · for products."""
    s = DerivTextPrinter(_shown(spec, extra)).doprint(_equalities(_decimals(expr)))
    return s.replace("**", "^").replace("*", "·")


# ---------------------------------------------------------------- documents

PREAMBLE = r"""\documentclass[11pt]{article}
\usepackage[utf8]{inputenc}
\usepackage[T1]{fontenc}
\usepackage{amsmath,amssymb}
\usepackage[margin=2.2cm]{geometry}
\allowdisplaybreaks
"""


def _subscript_math(m: re.Match) -> str:
    """A subscripted name marked by :func:`_tex_escape` (x, then the escaped _i) as the math
    x_i between \\x02 marks (dollar signs at the end); Σ as ``\\Sigma``."""
    base = "\\Sigma" if m.group(1) == "Σ" else m.group(1)
    return f"\x02{base}_{m.group(2)}\x02"


def _tex_escape(s: str) -> str:
    """Prose as LaTeX text: special characters escaped, subscripted names (x_i) and the Greek
    letters and symbols the prose uses set as math."""
    repl = {
        "\\": r"\textbackslash{}",
        "&": r"\&",
        "%": r"\%",
        "$": r"\$",
        "#": r"\#",
        "_": r"\_",
        "{": r"\{",
        "}": r"\}",
        "~": r"\textasciitilde{}",
        "^": r"\^{}",
    }
    # x_i, e_j, y_i, Σ_j: subscripted names become math first
    s = re.sub(r"(?<![A-Za-z])([A-Za-zΣ])_([a-z])(?![A-Za-z_])", "\x00\\1_\\2\x01", s)
    out = "".join(repl.get(ch, ch) for ch in s)
    out = re.sub("\x00(.)\\\\_(.)\x01", _subscript_math, out)
    return _unicode_tex(out).replace("\x02", "$")


# prose characters set in math: symbols by name, Greek and sub/superscripts from their
# Unicode names (_unicode_math), accents as \hat{} ... over the character before them
_MATH_SYMBOLS = {
    "·": r"\cdot",
    "⟨": r"\langle",
    "⟩": r"\rangle",
    "∂": r"\partial",
    "≡": r"\equiv",
    "←": r"\leftarrow",
    "→": r"\to",
    "√": r"\sqrt{}",
    "≠": r"\neq",
    "≤": r"\leq",
    "≥": r"\geq",
    "≈": r"\approx",
    "×": r"\times",
    "±": r"\pm",
    "∈": r"\in",
    "∞": r"\infty",
    "‖": r"\|",
    "∑": r"\sum",
    "′": "'",
    "⌊": r"\lfloor",
    "⌋": r"\rfloor",
    "ᵀ": r"^{\top}",
}
_TEXT_SYMBOLS = {"—": "---", "–": "--", "“": "``", "”": "''", "‘": "`", "’": "'", "−": "-", "…": r"\ldots{}"}
_ACCENTS = {"\u0302": "hat", "\u0307": "dot", "\u0304": "bar", "\u0308": "ddot", "\u0303": "tilde"}
_GREEK_CAPITALS = {"Gamma", "Delta", "Theta", "Lambda", "Xi", "Pi", "Sigma", "Upsilon", "Phi", "Psi", "Omega"}
_SCRIPT_NAMES = {
    "ZERO": "0",
    "ONE": "1",
    "TWO": "2",
    "THREE": "3",
    "FOUR": "4",
    "FIVE": "5",
    "SIX": "6",
    "SEVEN": "7",
    "EIGHT": "8",
    "NINE": "9",
    "PLUS SIGN": "+",
    "MINUS": "-",
}


def _unicode_math(ch: str) -> str | None:
    """The LaTeX math of a Greek letter or a sub/superscript character, from its Unicode
    name (δ -> \\delta, ₂ -> _{2}, ⁴ -> ^{4}, ₛ -> _{s}); None for anything else."""
    name = unicodedata.name(ch, "")
    for prefix, cap in (("GREEK SMALL LETTER ", False), ("GREEK CAPITAL LETTER ", True)):
        if name.startswith(prefix):
            word = name[len(prefix) :].split()[0].capitalize()
            if not cap:
                low = word.lower()
                return {"epsilon": r"\varepsilon", "omicron": "o", "final": r"\varsigma"}.get(low, "\\" + low)
            return "\\" + word if word in _GREEK_CAPITALS else unicodedata.lookup(f"LATIN CAPITAL LETTER {word[0]}")
    for key, mark in (("SUBSCRIPT ", "_"), ("SUPERSCRIPT ", "^")):
        if key in name:
            rest = name.split(key, 1)[1]
            what = _SCRIPT_NAMES.get(rest) or (rest.split()[-1].lower() if "LETTER" in rest else None)
            if what:
                return f"{mark}{{{what}}}"
    return None


def _unicode_tex(s: str) -> str:
    """ASCII LaTeX for prose: every character outside ASCII set as math (Greek, symbols,
    sub/superscripts, a combining accent over the character before it) or as a text
    ligature (dashes, quotes); adjacent math runs joined; anything unknown as its name."""
    tokens: list[list] = []  # [is_math, tex]
    for ch in unicodedata.normalize("NFD", s):
        if ch.isascii():
            tokens.append([False, ch])
        elif ch in _ACCENTS:
            base = tokens.pop()[1] if tokens else r"\,"
            tokens.append([True, f"\\{_ACCENTS[ch]}{{{base}}}"])
        elif ch in _TEXT_SYMBOLS:
            tokens.append([False, _TEXT_SYMBOLS[ch]])
        else:
            math = _MATH_SYMBOLS.get(ch) or _unicode_math(ch)
            tokens.append([True, math] if math else [False, f"[{unicodedata.name(ch, f'U+{ord(ch):04X}').lower()}]"])
    out, open_math = [], False
    for is_math, tex in tokens:
        if is_math != open_math:
            out.append("$")
            open_math = is_math
        # a command before a letter needs a space (\cdot x); math letters stay apart
        if is_math and out and out[-1][-1:].isalpha() and tex[:1].isalpha():
            out.append(" ")
        out.append(tex)
    if open_math:
        out.append("$")
    return "".join(out)


def _tex_mixed(s: str) -> str:
    """Prose with $...$ math segments: escape the prose, keep the math."""
    parts = s.split("$")
    return "".join("$" + p + "$" if i % 2 else _tex_escape(p) for i, p in enumerate(parts))


FORMATS = ("latex", "markdown", "text")


@dataclass(frozen=True)
class ModeDocument:
    """What a document shows of one mode, all computed before rendering: the derivation, its
    steps (:func:`derivgen.explain.steps.build_steps`), its proof (None: not checked) and, for
    the second-order section, the second order and its proof."""

    derivation: ModeDerivation
    steps: tuple
    proof: ModeProof | None = None
    second: SecondOrder | None = None
    second_proof: ModeProof | None = None


def check_format(fmt: str) -> None:
    """Raise ValueError unless ``fmt`` is one of :data:`FORMATS`."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be latex, markdown or text, got {fmt!r}")


def render(spec: Spec, modes: list[ModeDocument], fmt: str = "latex", standalone: bool = False) -> str:
    """The derivation document of a layer in LaTeX, Markdown or text, from data computed
    beforehand; a "Second order" section follows when the modes carry their second order."""
    check_format(fmt)
    second = render_second(spec, modes, fmt) if any(m.second is not None for m in modes) else ""
    if fmt == "latex":
        body = _render_latex(spec, modes) + second
        if standalone:
            return (
                PREAMBLE
                + f"\\title{{{_tex_escape(spec.title)}: the backward pass, derived}}\n\\author{{derivgen}}\n\\date{{}}\n"
                f"\\begin{{document}}\n\\maketitle\n{body}\\end{{document}}\n"
            )
        return body
    if fmt == "markdown":
        return _render_markdown(spec, modes) + second
    return _render_text(spec, modes) + second


def mode_names(mode: ModeDerivation) -> dict:
    """Display names beyond the spec's: the auxiliaries and the centred coordinate."""
    out = {s.name: s for s in mode.statistics}
    if mode.coordinate is not None:
        out[mode.coordinate.name] = mode.coordinate
    return out


def closed_forms_latex(spec: Spec, steps: Mapping[str, tuple], modes: Mapping[str, ModeDerivation]) -> str:
    """The closed forms of each mode (g, ∂L/∂x, the parameters' and the inputs' gradients, from
    its ``steps``) as one LaTeX ``aligned`` block: what a notebook shows for a derivation."""
    lines = []
    for name, mode_steps in steps.items():
        if len(steps) > 1:
            lines.append(rf"&\text{{{_mode_title(modes[name], len(steps))}}}")
        for step in mode_steps:
            if step.title not in ("Closed form", "Parameter gradients", "Gradients of the per-group inputs"):
                continue
            for eq in step.equations:
                if eq.rhs is not None and not eq.lhs_latex.startswith(r"\sum"):
                    lines.append(f"{eq.lhs_latex} &= {latex_expr(eq.rhs, spec, extra=mode_names(modes[name]))}")
    return r"\begin{aligned}" + " \\\\ ".join(lines) + r"\end{aligned}"


def _mode_title(mode: ModeDerivation, n_modes: int) -> str:
    if n_modes == 1:
        return ""
    return {"train": "Training mode", "eval": "Evaluation mode"}.get(mode.mode, mode.mode)


def _latex_notes(step) -> list[str]:
    """The notes of a step's equations as a LaTeX list (none: nothing)."""
    if not any(eq.note for eq in step.equations):
        return []
    out = [r"\begin{itemize}"]
    for eq in step.equations:
        if eq.note:
            note = _tex_mixed(eq.note_latex) if eq.note_latex else _tex_escape(eq.note)
            out.append(rf"\item ${eq.lhs_latex}$: {note}")
    out.append(r"\end{itemize}")
    return out


def _latex_step(step, spec: Spec, mode: ModeDerivation, heading: str) -> list[str]:
    """One step in LaTeX under ``heading`` (a sectioning command): prose, an align* block, the notes."""
    out = [f"{heading}{{{_tex_escape(step.title)}}}"]
    if step.prose:
        out.append(_tex_escape(step.prose))
    if step.equations:
        lines = []
        for eq in step.equations:
            if eq.rhs is None:
                lines.append(eq.lhs_latex.replace(" = ", " &= ", 1))
            else:
                lines.append(f"{eq.lhs_latex} &{_rel(eq, 'latex')} " + latex_expr(eq.rhs, spec, extra=mode_names(mode)))
        out += [r"\begin{align*}", " \\\\\n".join(lines), r"\end{align*}"]
        out += _latex_notes(step)
    out.append("")
    return out


def _render_latex(spec: Spec, modes: list[ModeDocument]) -> str:
    out = []
    if spec.summary:
        out.append(_tex_escape(spec.summary) + "\n")
    for note in spec.notes:
        out.append(r"\paragraph{Note.} " + _tex_escape(note) + "\n")
    for doc in modes:
        mode = doc.derivation
        mt = _mode_title(mode, len(modes))
        if mt:
            out.append(rf"\section{{{mt}}}")
        for step in doc.steps:
            out += _latex_step(step, spec, mode, r"\subsection*" if mt else r"\section*")
        out.append(_proof_latex(doc.proof))
    return "\n".join(out) + "\n"


def _rel(eq: object, kind: str) -> str:
    """An equation's relation ("=" unless the step says otherwise, as a buffer update's ←)."""
    return getattr(eq, f"rel_{kind}", "=")


def _proof_lines(proof: ModeProof | None) -> list[str]:
    if proof is None:
        return ["Not checked against brute force (run with proofs enabled)."]
    return [f"N = {r.n}: {r.status} ({r.method}, {r.seconds:.2f} s)" for r in proof.results]


def _proof_latex(proof: ModeProof | None) -> str:
    items = "\n".join(r"\item " + _tex_escape(line) for line in _proof_lines(proof))
    return (
        r"\section*{Proof against brute force}"
        "\n"
        "For each N the layer is built from N explicit scalar symbols, differentiated with "
        "sympy.diff, and the difference from the closed form above is reduced to zero in exact rational "
        "arithmetic (``proven''); where that does not finish within its budget of work it is evaluated in "
        "80-digit arithmetic at random rational points (``checked numerically'').\n"
        r"\begin{itemize}"
        "\n" + items + "\n"
        r"\end{itemize}"
        "\n"
    )


def _render_markdown(spec: Spec, modes: list[ModeDocument]) -> str:
    out = [f"# {spec.title}: the backward pass, derived", ""]
    if spec.summary:
        out += [spec.summary, ""]
    for note in spec.notes:
        out += [f"> **Note.** {note}", ""]
    for doc in modes:
        mode = doc.derivation
        mt = _mode_title(mode, len(modes))
        if mt:
            out += [f"## {mt}", ""]
        h = "###" if mt else "##"
        for step in doc.steps:
            out += [f"{h} {step.title}", ""]
            if step.prose:
                out += [step.prose, ""]
            for eq in step.equations:
                if eq.rhs is None:
                    out.append(f"$$ {eq.lhs_latex} $$")
                else:
                    rhs = latex_expr(eq.rhs, spec, extra=mode_names(mode))
                    out.append(f"$$ {eq.lhs_latex} {_rel(eq, 'latex')} {rhs} $$")
                if eq.note:
                    out.append(f"*{eq.note}*")
                out.append("")
        out += [f"{h} Proof against brute force", ""]
        out += [f"- {line}" for line in _proof_lines(doc.proof)] + [""]
    return "\n".join(out)


def _render_text(spec: Spec, modes: list[ModeDocument]) -> str:
    out = [f"{spec.title}: the backward pass, derived", "=" * (len(spec.title) + 30)]
    if spec.summary:
        out += [spec.summary]
    for note in spec.notes:
        out += [f"Note: {note}"]
    for doc in modes:
        mode = doc.derivation
        mt = _mode_title(mode, len(modes))
        if mt:
            out += ["", f"## {mt}"]
        for step in doc.steps:
            out += ["", f"{step.title}", "-" * len(step.title)]
            if step.prose:
                out += [step.prose]
            for eq in step.equations:
                rhs = (
                    "" if eq.rhs is None else f" {_rel(eq, 'text')} " + text_expr(eq.rhs, spec, extra=mode_names(mode))
                )
                out.append("  " + eq.lhs_text + rhs)
                if eq.note:
                    out.append(f"      ({eq.note})")
        out += ["", "Proof against brute force", "-------------------------"]
        out += [f"  {line}" for line in _proof_lines(doc.proof)]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- second order


def _backward_program(second: SecondOrder) -> str:
    """What the backward's own program holds, as the prose names it: " (statistics, x̂, g, its
    reductions)", each part only where the mode has it; empty when it has none."""
    first = second.first
    parts = [
        *(["statistics"] if first.statistics else []),
        *([first.coordinate.text] if first.coordinate is not None else []),
        *(["g"] if first.g is not None else []),
        *(["its reductions"] if first.reductions else []),
    ]
    return f" ({', '.join(parts)})" if parts else ""


def _second_prose(second: SecondOrder, extra: Mapping[str, Named] | None = None) -> str:
    """How the double backward and the JVP are derived, with their seeds and reductions
    (listed, as the first order's closed form lists its own)."""
    spec = second.spec
    cots = ", ".join(
        [
            second.cot_x.text,
            *(second.cot_tensors[t.name].text for t in spec.grad_tensors),
            *(second.cot_params[p.name].text for p in spec.params),
            *(second.cot_inputs[i.name].text for i in spec.inputs),
        ]
    )
    tans = ", ".join(
        [
            second.tan_x.text,
            *(second.tan_tensors[t.name].text for t in spec.grad_tensors),
            *(second.tan_params[p.name].text for p in spec.params),
            *(second.tan_inputs[i.name].text for i in spec.inputs),
        ]
    )

    def means(reductions: tuple) -> str:
        return ", ".join(text_expr(Mean(r.arg), spec, extra=extra) for r in reductions)

    if second.reductions:
        double = (
            f"to means of element monomials, {_count(len(second.reductions), 'reduction')} per group "
            f"({means(second.reductions)}): one sweep for them and one for the outputs"
        )
    else:
        double = "to no reduction over the group: one sweep for the outputs"
    jvp = (
        f"{_count(len(second.jvp_reductions), 'reduction')} per group ({means(second.jvp_reductions)})"
        if second.jvp_reductions
        else "no reduction over the group"
    )
    dirac = (
        " Terms from |u| (a DiracDelta, the derivative of sign(u)) are dropped: zero wherever the first "
        "derivative exists."
        if _has_abs(second)
        else ""
    )
    core = ""
    if second.cot_core is not None:  # the backward in the core value sees one seed of each kind
        h = spec.core.text
        core = (
            f" Both see {h} = {text_expr(spec.core.expr, spec, extra=extra)} through one seed per element: "
            f"{second.cot_core.text} = {text_expr(second.cot_core_expr, spec, extra=extra)} and "
            f"{second.tan_core.text} = {text_expr(second.tan_core_expr, spec, extra=extra)}; the gradients of x and "
            f"the tensors {h} is made of are ∂L₂/∂{h}, computed once, times ∂{h}/∂v"
            + (", plus what they read directly." if any(v != 0 for v in second.direct.values()) else ".")
        )
    outs = ""
    if spec.outputs:
        names = ", ".join(f"∂L/∂{o.text}" for o in spec.outputs)
        outs = (
            f" The backward's inputs include the gradients {names} arriving at the outputs beside y (δ"
            f"{spec.outputs[0].text} in the first order; δ is the seeds' here), so the double backward also "
            "gives L₂'s gradient with respect to each."
        )
    return (
        f"The double backward is the vector-Jacobian product of the backward above: with the cotangents "
        f"{cots} of the backward's outputs it differentiates L₂ = Σ δx·∂L/∂x + Σ δp·∂L/∂p + ... once more, "
        f"by reverse mode through the backward's own program{_backward_program(second)}, and the "
        f"nested means collapse by linearity and the known statistics {double}. "
        f"The JVP is forward mode through the forward program with the tangents {tans}: {jvp}."
        + outs
        + core
        + dirac
        + "".join(" " + note for note in spec.second_order_notes)
    )


def _has_abs(second: SecondOrder) -> bool:
    """Whether the layer's expressions take an absolute value (or a sign), whose second
    derivative is a DiracDelta that the second order drops."""
    spec, first = second.spec, second.first
    exprs = [spec.output, spec.normalized_expr, *(st.expr for st in first.statistics)]
    for group in (spec.values, spec.outputs, spec.windows):
        exprs += [getattr(item, "expr", None) for item in group]
    mode = spec.mode(first.mode)
    exprs += [st.expr for st in (*mode.statistics, *mode.blocks)]
    return any(isinstance(e, sympy.Basic) and e.has(sympy.Abs, sympy.sign) for e in exprs)


def _count(n: int, noun: str) -> str:
    """``n`` ``noun``s, singular for one."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _second_equations(second: SecondOrder) -> list[tuple[str, str, object]]:
    """[(lhs latex, lhs text, rhs)]: the double backward's outputs and ẏ (the reductions
    they read are listed in the prose, as the means the equations spell out)."""
    spec = second.spec
    eqs = []
    eqs.append((r"\frac{\partial L_2}{\partial x}", "∂L₂/∂x", second.dx))
    eqs.append((r"\frac{\partial L_2}{\partial (\partial L/\partial y)}", "∂L₂/∂(∂L/∂y)", second.ddy))
    for o in spec.outputs:
        eqs.append(
            (
                rf"\frac{{\partial L_2}}{{\partial (\partial L/\partial \mathrm{{{o.name}}})}}",
                f"∂L₂/∂(∂L/∂{o.name})",
                second.ddouts[o.name],
            )
        )
    for t in spec.grad_tensors:
        eqs.append((rf"\frac{{\partial L_2}}{{\partial {t.latex}}}", f"∂L₂/∂{t.text}", second.dtensors[t.name]))
    for p in spec.params:
        gr = second.grads[p.name]
        e = gr.element if gr.group == 0 else gr.element + gr.group
        eqs.append((rf"\frac{{\partial L_2}}{{\partial {p.latex}}}", f"∂L₂/∂{p.text}", e))
    for i in spec.inputs:
        eqs.append((rf"\frac{{\partial L_2}}{{\partial {i.latex}}}", f"∂L₂/∂{i.text}", second.dinputs[i.name]))
    eqs.append((r"\dot{y}", "ẏ", second.ty))
    for o in spec.outputs:  # (an output that is the core value: its tangent is ḣ, given in the prose)
        if second.tan_core is None or second.touts[o.name] != second.tan_core.symbol:
            eqs.append((rf"\dot{{\mathrm{{{o.name}}}}}", f"{o.name}̇", second.touts[o.name]))
    return eqs


def _second_proof_lines(proof: ModeProof | None) -> list[str]:
    if proof is None:
        return ["not checked (run with proofs enabled)"]
    return [f"N = {r.n}: {r.status} ({r.method}, {r.seconds:.2f} s)" for r in proof.results]


def render_second(spec: Spec, modes: list[ModeDocument], fmt: str) -> str:
    """The "Second order" section of a derivation document (``derivgen derive --order 2``),
    from each mode's second order and its proof (None: not checked)."""
    out = []
    for doc in modes:
        mode, second = doc.derivation, doc.second
        # δ is the second order's seeds here: the gradient arriving at an output beside y (δh
        # above) is written ∂L/∂h
        arriving = {
            o.cotangent.name: ShownAs(
                o.cotangent.name, o.cotangent, rf"\frac{{\partial L}}{{\partial {o.latex}}}", f"∂L/∂{o.text}"
            )
            for o in spec.outputs
        }
        extra = {**mode_names(mode), **arriving, **second.names}
        prose, eqs, lines = (
            _second_prose(second, extra),
            _second_equations(second),
            _second_proof_lines(doc.second_proof),
        )
        mt = _mode_title(mode, len(modes))
        title = "Second order" + (f" ({mt.lower()})" if mt else "")
        if fmt == "latex":
            out += [
                rf"\section*{{{title}}}",
                _tex_escape(prose),
                r"\begin{align*}",
                " \\\\\n".join(f"{lhs} &= {latex_expr(e, spec, extra=extra)}" for lhs, _, e in eqs),
                r"\end{align*}",
                (
                    r"\paragraph{Proof against brute force.} Second derivatives of the "
                    r"explicit layer at small N (sympy.diff twice) against the closed forms:"
                ),
                r"\begin{itemize}",
                *(r"\item " + _tex_escape(x) for x in lines),
                r"\end{itemize}",
                "",
            ]
        elif fmt == "markdown":
            out += [f"## {title}", "", prose, ""]
            out += [f"$$ {lhs} = {latex_expr(e, spec, extra=extra)} $$\n" for lhs, _, e in eqs]
            out += ["Proof against brute force (second derivatives of the explicit layer):", ""]
            out += [f"- {x}" for x in lines] + [""]
        else:
            out += ["", title, "-" * len(title), prose]
            out += [f"  {t} = {text_expr(e, spec, extra=extra)}" for _, t, e in eqs]
            out += ["", "  Proof against brute force (second derivatives):"] + [f"    {x}" for x in lines]
    return "\n".join(out) + "\n"
