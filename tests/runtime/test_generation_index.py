"""derivgen.load's disk index of generated code: a later process imports what an earlier one
generated without deriving again; the key is the same in every process and changes with the
spec; a damaged entry or a process with a function of its own generates again."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

from conftest import ROOT

import derivgen
from derivgen import api

# derive() replaced by one that fails: only the index can give the module
_LOAD_WITHOUT_DERIVING = """
import sys
import derivgen, derivgen.api as api
def refuse(*a, **k):
    raise SystemExit("derived")
api.derive = refuse
m = derivgen.load(sys.argv[1], backend="numpy")
print(m.__name__)
"""

_KEY = """
import derivgen, derivgen.api as api
print(api._generation_key(derivgen.load_spec("switchnorm"), "c"))
"""


def _python(code: str, cache, *args, seed: str = "0") -> subprocess.CompletedProcess:
    env = dict(os.environ, DERIVGEN_CACHE=str(cache), PYTHONHASHSEED=seed, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600)


def test_a_later_process_loads_without_deriving(tmp_path):
    cache = tmp_path / "cache"
    first = _python(_LOAD_WITHOUT_DERIVING, cache, "rmsnorm")
    assert first.returncode != 0 and "derived" in first.stderr  # nothing indexed yet: it had to derive
    made = _python("import derivgen; derivgen.load('rmsnorm', backend='numpy')", cache)
    assert made.returncode == 0, made.stderr
    assert len(list((cache / "modules" / "index").glob("*.json"))) == 1
    again = _python(_LOAD_WITHOUT_DERIVING, cache, "rmsnorm")
    assert again.returncode == 0, again.stderr
    assert "rmsnorm" in again.stdout


def test_a_damaged_entry_is_generated_again(tmp_path, monkeypatch):
    monkeypatch.setenv("DERIVGEN_CACHE", str(tmp_path))
    spec = derivgen.load_spec("rmsnorm")
    root, digest = api.materialize(spec, "numpy")
    (py,) = root.glob("*.py")
    good = py.read_text()
    py.write_text(good + "\nraise SystemExit('edited')\n")
    root2, digest2 = api.materialize(spec, "numpy")  # the digest no longer matches: written again
    assert (root2, digest2) == (root, digest) and py.read_text() == good
    for index in (tmp_path / "modules" / "index").glob("*.json"):
        index.write_text("{not json")
    assert api.materialize(spec, "numpy") == (root, digest)


def test_the_key_is_the_same_in_every_process_and_follows_the_spec(tmp_path):
    keys = {_python(_KEY, tmp_path, seed=s).stdout.strip() for s in ("1", "777")}
    assert len(keys) == 1 and len(next(iter(keys))) == 32  # SwitchNorm's sets of block kinds
    spec = derivgen.load_spec("layernorm")
    other = replace(spec, options=tuple(replace(o, default=1e-3) for o in spec.options))
    assert api._generation_key(spec, "c") != api._generation_key(other, "c")
    assert api._generation_key(spec, "c") != api._generation_key(spec, "numpy")


def test_a_function_of_ones_own_turns_the_index_off():
    from derivgen.symbolic import functions

    spec = derivgen.load_spec("layernorm")
    assert api._generation_key(spec, "numpy") is not None
    functions.register(replace(functions.TABLE["tanh"], name="my_tanh"))
    try:
        assert api._generation_key(spec, "numpy") is None
    finally:
        functions.unregister("my_tanh")
    assert api._generation_key(spec, "numpy") is not None
