"""spec/model.py's computed properties of a parsed Spec, and the spec package's layout:
the types, the parser and the library in their own modules, one face."""

from __future__ import annotations

import pytest

import derivgen.spec
from derivgen.spec import catalogue_names, load_catalogue, zoo_names


def _expected_buffer_reads(spec):
    """The modes whose group statistics name a buffer, computed from the statistics' symbols."""
    buffers = {b.symbol for b in spec.buffers}
    return tuple(m.name for m in spec.modes if any(st.expr.free_symbols & buffers for st in m.statistics))


@pytest.mark.parametrize(
    ("name", "reads"),
    [
        ("batchnorm", ("eval",)),  # eval normalizes with the running statistics
        ("batch_renorm", ("train", "eval")),  # r and d read them in training too
        ("layernorm", ()),  # no buffers at all
        ("rmsnorm", ()),
    ],
)
def test_buffer_reads_names_the_modes_that_read_the_running_buffers(name, reads):
    spec = load_catalogue(name)
    assert spec.buffer_reads == reads
    for mode in spec.modes:
        assert spec.reads_buffers(mode.name) == (mode.name in reads)
    assert spec.reads_buffers() == (spec.modes[0].name in reads)  # None: the training mode


def test_buffer_reads_of_every_built_in_layer():
    for name in catalogue_names() + zoo_names():
        spec = load_catalogue(name)
        assert spec.buffer_reads == _expected_buffer_reads(spec), name
        assert not spec.buffer_reads or spec.buffers, name


def test_reads_buffers_of_an_unknown_mode_is_a_key_error():
    with pytest.raises(KeyError):
        load_catalogue("batchnorm").reads_buffers("inference")


def test_the_face_offers_the_types_the_parser_and_the_library():
    from derivgen.spec import library, model, parse

    assert derivgen.spec.Spec is model.Spec and derivgen.spec.SpecError is model.SpecError
    assert derivgen.spec.parse_spec is parse.parse_spec
    assert derivgen.spec.load_catalogue is library.load_catalogue
    assert derivgen.spec.load_spec_file is library.load_spec_file
    assert not hasattr(model, "parse_spec") and not hasattr(model, "load_catalogue")  # the types alone
