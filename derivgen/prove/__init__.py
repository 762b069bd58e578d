"""Stage 3, proof: the closed forms against brute-force differentiation of the forward,
unrolled at small N (symbolically, or by exact evaluation when SymPy runs out of time).
"""

from derivgen.prove.proof import ModeProof, ProofResult, prove_derivation, prove_mode, prove_second_mode

__all__ = ["ModeProof", "ProofResult", "prove_derivation", "prove_mode", "prove_second_mode"]
