"""Tools above the pipeline: ``generate`` (write ``generated/``, check it is current),
``check`` (cross-check every backend against finite differences, the other backend and
PyTorch), ``bench`` (side-by-side timings), ``baseline`` (plain NumPy by hand),
``evaluate`` (numeric evaluation of derived expressions) and ``torch_ref`` (PyTorch
autograd references). Used by the command line and the tests; nothing below imports them.
"""
