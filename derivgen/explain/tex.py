"""Prose as LaTeX text: special characters escaped, subscripted names (x_i) and the Greek
letters, symbols and sub/superscripts the prose uses set as math from their Unicode names
(:func:`_tex_escape`; :func:`_tex_mixed` for prose with $...$ math).
"""

from __future__ import annotations

import re
import unicodedata


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
