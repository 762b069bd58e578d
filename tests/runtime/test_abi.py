"""derivgen.runtime.abi: the one description of the C kernels' calling convention is what the
generated C declares (headers and the split kernels in the .c files), and what the
bindings pack."""

import importlib
import re

import pytest
from conftest import ROOT

from derivgen.api import derive, load_spec
from derivgen.codegen.emit import emit
from derivgen.runtime.abi import KINDS, SPLIT_KINDS, KernelSignature, call_runs, kernel_signature, kernel_signatures
from derivgen.spec import catalogue_names

ELEM = {"f32": "float", "f64": "double", "bf16": "dg_bf16"}
PROTO = re.compile(r"^int (\w+)\(\n(.*?)\)(?:;|\n\{)", re.DOTALL | re.MULTILINE)


def _prototypes(text: str) -> dict[str, str]:
    """Every ``int name(...)`` prototype or definition in C text, blank lines dropped."""
    out = {}
    for m in PROTO.finditer(text):
        body = "\n".join(line for line in m.group(2).split("\n") if line.strip())
        out[m.group(1)] = f"int {m.group(1)}(\n{body})"
    return out


def _described(meta: dict, sfx: str, kinds) -> dict[str, str]:
    """The prototypes rendered from the description for one suffix."""
    elem = ELEM[sfx.removeprefix("nhwc_")]
    out = {}
    for (mode, kind), sig in kernel_signatures(meta).items():
        if kind in kinds:
            out[sig.symbol(sfx)] = sig.c_prototype(sfx, elem)
    return out


def _check_layer(meta: dict, header: str, source: str) -> None:
    declared = _prototypes(header)
    expected = {}
    for sfx in ("f32", "f64"):
        expected.update(_described(meta, sfx, KINDS))
    expected.update(_described(meta, "bf16", ("forward", "backward")))
    assert declared == expected
    defined = _prototypes(source)
    for sfx in ("f32", "f64"):
        for name, text in _described(meta, sfx, KINDS + SPLIT_KINDS).items():
            assert defined[name] == text
    nhwc = {k: v for k, v in defined.items() if "_nhwc_" in k}
    for name, text in nhwc.items():
        sfx = "nhwc_" + name.rsplit("_", 1)[1]
        assert text == _described(meta, sfx, ("forward", "backward"))[name]


@pytest.mark.parametrize("name", catalogue_names())
def test_generated_headers_declare_the_described_prototypes(name):
    meta = importlib.import_module(f"generated.c.{name}")._META
    folder = ROOT / "generated" / "c"
    _check_layer(meta, (folder / f"{name}.h").read_text(), (folder / f"{name}.c").read_text())


@pytest.mark.parametrize("example", ["dynamic_tanh", "layernorm_nobias"])
def test_example_specs_declare_the_described_prototypes(example):
    d = derive(load_spec(ROOT / "examples" / f"{example}.toml"))
    emitted = emit(d, targets=("c",))
    files, meta = emitted.files, emitted.meta
    _check_layer(meta, files[f"c/{meta['name']}.h"], files[f"c/{meta['name']}.c"])


def test_pack_checks_sections():
    meta = importlib.import_module("generated.c.online_layernorm")._META
    sig = kernel_signature(meta, "train", "forward")
    assert isinstance(sig, KernelSignature)
    assert sig.section_size("inputs") == 2 * len(meta["inputs"])
    values = {
        "dims": (1, 1, 4, 1),
        "x": (10,),
        "params": [11] * len(meta["params"]),
        "options": [0.5] * len(meta["options"]),
        "inputs": [12, 0] * len(meta["inputs"]),
        "buffers": [None] * len(meta["buffers"]),
        "y": (13,),
        "stats": [14] * len(meta["stats"]["train"]),
        "nthreads": (0,),
    }
    args = sig.pack(values)
    assert len(args) == len(sig.args) and args[:5] == [1, 1, 4, 1, 10]
    with pytest.raises(ValueError, match="section params"):
        sig.pack({**values, "params": []})
    with pytest.raises(ValueError, match="no section"):
        sig.pack({**values, "bogus": ()})
    with pytest.raises(ValueError, match="do not follow"):
        sig.packer(("x", "dims"))
    fast = sig.packer(
        ("dims", "x_params", "options", "inputs", "buffers", "y", "stats", "nthreads"),
        merged={"x_params": ("x", "params")},
    )
    assert fast(values["dims"], [10, *values["params"]], *(values[s] for s in sig.sections[3:])) == args
    with pytest.raises(ValueError, match="arguments expected"):
        fast((), (), (), (), (), (), (), ())


def test_unknown_kernels_are_refused():
    meta = importlib.import_module("generated.c.layernorm")._META
    with pytest.raises(ValueError, match="no split kernels"):
        kernel_signature(meta, "train", "split_partial")
    with pytest.raises(ValueError, match="unknown kernel kind"):
        kernel_signature(meta, "train", "sideways")
    with pytest.raises(ValueError, match="no mode"):
        kernel_signature(meta, "eval", "forward")


def test_call_runs_classify_the_arguments():
    """The runs derivgen.torch's C++ extension calls a kernel by: layer norm's forward is the
    dims, x and two parameters (7 integers or pointers), one double (eps), y and three
    statistics (4 pointers), and the thread count; kernels with per-group inputs (a stride
    among the trailing pointers) or split kernels (an int level) have no such shape."""
    meta = importlib.import_module("generated.c.layernorm")._META
    assert call_runs(kernel_signature(meta, "train", "forward")) == (7, 1, 4)
    assert call_runs(kernel_signature(meta, "train", "backward")) == (8, 1, 6)  # dy; 3 stats, dx, 2 dparams
    online = importlib.import_module("generated.c.online_layernorm")._META
    assert call_runs(kernel_signature(online, "train", "forward")) is None
    bn = importlib.import_module("generated.c.batchnorm")._META
    assert call_runs(kernel_signature(bn, "train", "forward")) == (7, 2, 6)  # 2 NULL buffers, y, 3 stats
    assert call_runs(kernel_signature(bn, "train", "split_partial")) is None
    sig = kernel_signature(meta, "train", "forward")
    for k in (0, 4, len(sig.args) - 1):  # a double among the integers, an int64 among the pointers, no int last
        a = list(sig.args)
        a[k] = type(a[k])(a[k].name, a[k].section, "double" if k < 7 else "int64_t")
        assert call_runs(KernelSignature(sig.layer, sig.mode, sig.kind, tuple(a), sig.sections)) is None, k
