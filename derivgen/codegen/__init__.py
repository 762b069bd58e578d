"""Stage 5, code generation: derivations in, source text out.

* :mod:`~derivgen.codegen.ir`: each mode's forward, backward and second-order programs as
  plain data (loops, assignments, reductions);
* :mod:`~derivgen.codegen.printers`: ``SpecPrinter``, one per spec: SymPy expressions as
  NumPy, PyTorch and C text (the JAX target's printer: :mod:`~derivgen.codegen.jax.printer`);
* :mod:`~derivgen.codegen.c.plan`: the C kernels' plans (statements per element type,
  sweeps, split-reduction levels), computed once per layer;
* :mod:`~derivgen.codegen.triton.printer`, :mod:`~derivgen.codegen.triton.plan`: the Triton
  target's printing and its kernels' plans (the same IR as the C, laid out as tiles of a group);
* :mod:`~derivgen.codegen.targets`: the targets as data, one ``Target`` record each (its
  templates and files, planner, filters, what it refuses, reserved words, function spellings,
  run-time package); a new target is a record and its folder;
* :mod:`~derivgen.codegen.emit`: builds IR and plans, then renders each target's Jinja templates
  (``templates/``), which only lay out text. The kernels' calling convention comes from
  :mod:`derivgen.runtime.abi`.
"""

from derivgen.codegen.emit import Emitted, emit

__all__ = ["Emitted", "emit"]
