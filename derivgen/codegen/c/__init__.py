"""The C target: each mode's kernels planned per element type, computed once per layer
before rendering, as plain data the templates lay out.

Its modules, each importing only those above it in this list:

* ``ctext``: the element types and the C text of loads and stores (``c_load``, ``c_store``);
* ``types``: the plan types (``CLoop``, ``Sweep``, ``BlockPass``, ``KernelPlan`` ...);
* ``names``: the one naming table of element loads and group values;
* ``blocks``: block means as passes over the group (``BlockPass``);
* ``hoist``: a block sweep's arithmetic shared along a run of positions, as run values;
* ``layouts``: what channels-last and rows-in-lockstep sweeps read (``NhwcSweep``, ``RowSweep``);
* ``windows``: a static C function per window;
* ``sweep``: the sweep planner of the forward and backward kernels (``CPlanner``);
* ``second``: the double backward and the JVP;
* ``plan``: ``plan_kernel``, a mode's kernels for one element type.

The templates (``templates/``): ``kernel.c.j2`` (a layer's file) imports ``_c_sweep.j2``
(sweeps over an NCHW or trailing group, the kernels' dimensions), ``_c_backward.j2``,
``_c_split.j2`` (the split reduction), ``_c_second.j2``, ``_nhwc.j2`` and
``_c_nhwc_batch.j2`` (channels last), ``_position.j2``; the last three lay out blocks of
groups over ``_c_groups.j2``'s shared bodies. ``kernel.h.j2`` is the header,
``derivgen-kernels.h.j2`` (with ``_c_kernels_math.j2``) the header every layer shares.
"""

from derivgen.codegen.c.ctext import ATYPES, CTYPES, c_load, c_store
from derivgen.codegen.c.plan import plan_kernel

__all__ = ["ATYPES", "CTYPES", "c_load", "c_store", "plan_kernel"]
