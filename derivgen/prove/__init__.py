"""Stage 3, proof: the closed forms against brute-force differentiation of the forward,
unrolled at small N (symbolically, or by exact evaluation when SymPy runs out of time).

* :mod:`~derivgen.prove.proof`: ``prove_mode``, ``prove_second_mode``: each size settled
  under its budget of work and a guard in seconds; ``ModeProof``, ``ProofResult``;
* :mod:`~derivgen.prove.explicit`: the layer written out at N explicit elements, and its
  brute-force derivatives;
* :mod:`~derivgen.prove.checks`: what is compared at one size, for both orders;
* :mod:`~derivgen.prove.zero`: a difference reduced to zero symbolically, region by region;
* :mod:`~derivgen.prove.exact`: the exact rational arithmetic that reduction counts in work;
* :mod:`~derivgen.prove.numeric`: 80-digit evaluation at random rational points.
"""

from derivgen.prove.proof import ModeProof, ProofResult, prove_derivation, prove_mode, prove_second_mode

__all__ = ["ModeProof", "ProofResult", "prove_derivation", "prove_mode", "prove_second_mode"]
