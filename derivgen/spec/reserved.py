"""Names the targets reserve: what a spec identifier may not be called because the
generated code (Python: NumPy and PyTorch; C) would not compile or would hide
something it uses.

This is the code generators' knowledge, kept as data in a bottom-layer module so
that the spec parser can reject such names when it validates a spec without
importing the code generators. Each target declares its language keywords and
the library names its code uses; the C library functions of the elementary
functions come from their table (:mod:`derivgen.symbolic.functions`).
"""

from __future__ import annotations

import keyword
from collections.abc import Callable

from derivgen.symbolic import functions

# a block of words, as the language's standard lists them (SIM905 would make it one quoted word a line)
C_KEYWORDS = frozenset(
    """
auto break case char const continue default do double else enum extern float for goto if
inline int long register restrict return short signed sizeof static struct switch typedef
union unsigned void volatile while bool complex imaginary
""".split()  # noqa: SIM905
)

# the C library functions and types the generated C uses besides the table's functions
C_LIBRARY_EXTRA = frozenset({"pow", "powf", "malloc", "calloc", "free", "int64_t", "uintptr_t", "size_t", "main"})


# the module names the generated Triton kernels use (the Triton target, templates/triton.py.j2):
# its kernels must name Triton's language module ``tl`` (its interpreter recognizes
# ``tl.constexpr`` by that spelling)
TRITON_NAMES = frozenset({"tl", "triton"})


# derivgen.torch.Module makes a spec's options and parameters its attributes (``m.eps``): they
# may not take the name of an attribute or method torch.nn.Module has (public names, as of
# torch 2.13; tests/spec/test_user_specs.py checks this list against the installed torch), one
# that Hugging Face transformers sets on torch.nn.Module once a pretrained model initializes
# its weights (smart_apply), or one derivgen.torch.Module keeps itself
TORCH_MODULE_NAMES = frozenset(
    """
T_destination add_module apply bfloat16 buffers call_super_init children compile cpu cuda double
dump_patches eval extra_repr float forward get_buffer get_extra_state get_parameter get_submodule
half ipu load_state_dict modules mtia named_buffers named_children named_modules named_parameters
parameters register_backward_hook register_buffer register_forward_hook register_forward_pre_hook
register_full_backward_hook register_full_backward_pre_hook register_load_state_dict_post_hook
register_load_state_dict_pre_hook register_module register_parameter register_state_dict_post_hook
register_state_dict_pre_hook requires_grad_ set_extra_state set_submodule share_memory state_dict
to to_empty train type xpu zero_grad
smart_apply
layer_name sync process_group device dtype
""".split()  # noqa: SIM905
)


def is_keyword(name: str) -> bool:
    """``name`` is a keyword of a target language (Python or C)."""
    return keyword.iskeyword(name) or name in C_KEYWORDS


def c_library() -> frozenset[str]:
    """The C library names the generated C uses (a local of that name would hide them):
    the elementary functions' C spellings that are names, and the others it calls."""
    names = {s for fn in functions.TABLE.values() for s in (fn.c_double, fn.c_float) if s.isidentifier()}
    return C_LIBRARY_EXTRA | names


# The reserved words by kind, in the order a collision is reported: (why, the words). Each
# code-generation target (derivgen.codegen.targets) names the kinds its code needs; the spec
# stage checks every kind, without importing the code generators.
RESERVED: dict[str, tuple[str, Callable[[], frozenset[str]]]] = {
    "python": ("a Python keyword", lambda: frozenset(keyword.kwlist)),
    "c": ("a C keyword", lambda: C_KEYWORDS),
    "c_library": ("a C library name the generated code uses", c_library),
    "triton": ("a module name the generated Triton code uses", lambda: TRITON_NAMES),
    "torch_module": (
        "an attribute of derivgen.torch.Module (its options and parameters are attributes)",
        lambda: TORCH_MODULE_NAMES,
    ),
}


def collision(name: str) -> str | None:
    """Why ``name`` collides with a target language (a keyword, a library name), or None."""
    for why, words in RESERVED.values():
        if name in words():
            return why
    return None
