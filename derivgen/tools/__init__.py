"""Tools above the pipeline: ``generate`` (write ``generated/``, check it is current),
``check`` (cross-check every backend against finite differences, the other backend and
PyTorch), ``baseline`` (plain NumPy by hand), ``evaluate`` (numeric evaluation of derived
expressions), ``torch_ref`` (PyTorch autograd references), the benches (``bench``: generated
C and NumPy side by side with its references in ``bench_refs``, its targets in
``bench_targets``, its report in ``bench_report`` and the shared timing in ``timing``;
``bench_torch``, ``bench_bf16``, ``bench_sync``: derivgen.torch's modules and operators;
``bench_jax``: derivgen.jax against Flax) and ``demo`` (``make demo``'s training run with
derivgen.torch). Used by the command line and the tests; nothing below imports them.
"""
