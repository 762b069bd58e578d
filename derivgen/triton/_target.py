"""What the generated Triton modules (``generated/triton/<layer>.py``) call inside their kernels.

The printed expressions name their functions ``_tt.sqrt``, ``_tt.exp``, ``_tt.maximum`` ...
(each entry's name in :mod:`derivgen.symbolic.functions`); here each is a ``triton.jit``
function of ``triton.language`` primitives only, so it runs compiled on a GPU and under
Triton's interpreter (``TRITON_INTERPRET=1``) alike (the interpreter has no ``libdevice``).
Beside them, the index arithmetic every kernel shares: a normalization group as a matrix
of A rows and B columns, ROWS groups at a time (:func:`group_base`, :func:`tile`, the
group reductions :func:`gsum`, :func:`gmax`, :func:`gmin`), and the per-program partial sums
of the parameter gradients (:func:`add_partial`, :func:`col_sums`) that
:func:`sum_rows_kernel` reduces.
"""

import triton
import triton.language as tl

# ---- the elementary functions of derivgen.symbolic.functions, by name


@triton.jit
def sqrt(u):
    """Square root (correctly rounded)."""
    return tl.sqrt_rn(u)


@triton.jit
def exp(u):
    """e**u."""
    return tl.exp(u)


@triton.jit
def log(u):
    """Natural logarithm."""
    return tl.log(u)


@triton.jit
def abs(u):
    """|u|."""
    return tl.abs(u)


@triton.jit
def sign(u):
    """-1, 0 or 1."""
    return tl.where(u > 0, 1.0, tl.where(u < 0, -1.0, 0.0))


@triton.jit
def tanh(u):
    """tanh(u) = sign(u) (1 - e)/(1 + e) with e = exp(-2|u|): no overflow."""
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(u < 0, -t, t)


@triton.jit
def sigmoid(u):
    """1/(1 + exp(-u)), without overflow on either side."""
    z = tl.exp(-tl.abs(u))
    return tl.where(u >= 0, 1.0 / (1.0 + z), z / (1.0 + z))


@triton.jit
def log1p(t):
    """log(1 + t), accurate for small t (Goldberg: log(w) t/(w - 1) with w = 1 + t)."""
    w = 1.0 + t
    d = w - 1.0
    return tl.where(d == 0.0, t, tl.log(w) * (t / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def softplus(u):
    """log(1 + exp(u)) as max(u, 0) + log1p(exp(-|u|)): no overflow (NumPy's logaddexp(u, 0))."""
    return tl.maximum(u, 0.0) + log1p(tl.exp(-tl.abs(u)))


@triton.jit
def erf(u):
    """The error function."""
    return tl.erf(u)


@triton.jit
def stop_gradient(u):
    """u (its derivative is zero: the engine has already used that)."""
    return u


@triton.jit
def maximum(a, b):
    """The larger of a and b."""
    return tl.maximum(a, b)


@triton.jit
def minimum(a, b):
    """The smaller of a and b."""
    return tl.minimum(a, b)


@triton.jit
def clip(u, lo, hi):
    """min(max(u, lo), hi)."""
    return tl.minimum(tl.maximum(u, lo), hi)


@triton.jit
def step(t):
    """1 where t > 0, 1/2 where t == 0, 0 where t < 0 (heaviside with 1/2 at 0)."""
    return tl.where(t > 0, 1.0, tl.where(t == 0, 0.5, 0.0))


@triton.jit
def indicator(t):
    """1 where t >= 0, else 0."""
    return tl.where(t >= 0, 1.0, 0.0)


@triton.jit
def step_cmp(a, b):
    """step(a - b) by comparison (no fused multiply-add can move a tie)."""
    return tl.where(a > b, 1.0, tl.where(a == b, 0.5, 0.0))


@triton.jit
def indicator_cmp(a, b):
    """indicator(a - b) by comparison."""
    return tl.where(a >= b, 1.0, 0.0)


@triton.jit
def pow(b, e):
    """b**e for b > 0 (and 0**e = 0 for e > 0), as exp(e log b)."""
    return tl.where(b == 0.0, 0.0, tl.exp(e * tl.log(b)))


# ---- a group as a matrix, tiles of it, and the parameters' partial sums


@triton.jit
def group_base(Grp, G, Cg, sO, sC, PCHAN: tl.constexpr):
    """The first element of each group ``Grp`` and its first parameter channel: sample
    ``Grp // G`` (0 for batch statistics, where there are G groups), group ``Grp % G``.
    Where the channel runs along the columns (PCHAN 2: rows of x, and a position's
    channels, G the positions of a sample and Cg 1), a group's channels are all of them."""
    O_i = Grp // G
    G_i = Grp % G
    Base = tl.cast(O_i, tl.int64) * sO + tl.cast(G_i * Cg, tl.int64) * sC
    if PCHAN == 2:
        return Base, G_i * 0
    return Base, G_i * Cg


@triton.jit
def tile(Base, Chan0, GOk, A0, B0, A, B, sA, sB, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, PCHAN: tl.constexpr):
    """A [ROWS, BLOCK_A, BLOCK_B] tile: from row A0 and column B0 of the matrix of each of
    ROWS groups (``Base``, ``Chan0``, ``GOk``: [ROWS, 1, 1]), the elements' offsets, the mask
    of those inside a group that exists, the parameters' channel of each (PCHAN 0: the
    group's; 1: along the rows; 2: along the columns), the row and column indices."""
    Ia = A0 + tl.arange(0, BLOCK_A)[None, :, None]
    Ib = B0 + tl.arange(0, BLOCK_B)[None, None, :]
    Mask = GOk & (Ia < A) & (Ib < B)
    Offs = Base + tl.cast(Ia, tl.int64) * sA + tl.cast(Ib, tl.int64) * sB
    if PCHAN == 1:
        Chan = Chan0 + Ia + Ib * 0
    elif PCHAN == 2:
        Chan = Chan0 + Ib + Ia * 0
    else:
        Chan = Chan0 + Ia * 0 + Ib * 0
    return Offs, Mask, Chan, Ia, Ib


@triton.jit
def gsum(V):
    """The sums over each group of a [ROWS, BLOCK_A, BLOCK_B] tile: [ROWS, 1, 1]."""
    return tl.sum(tl.sum(V, axis=2, keep_dims=True), axis=1, keep_dims=True)


@triton.jit
def gmax(V):
    """The maxima over each group of a tile: [ROWS, 1, 1]."""
    return tl.max(tl.max(V, axis=2, keep_dims=True), axis=1, keep_dims=True)


@triton.jit
def gmin(V):
    """The minima over each group of a tile: [ROWS, 1, 1]."""
    return tl.min(tl.min(V, axis=2, keep_dims=True), axis=1, keep_dims=True)


@triton.jit
def col_sums(V, Mask):
    """A tile's values summed over its groups and rows, per column: [BLOCK_B]."""
    return tl.sum(tl.sum(tl.where(Mask, V, 0.0), axis=1), axis=0)


@triton.jit
def add_partial(P, Row, V, Mask, Chan0, Ia, Ib, A, B, PCHAN: tl.constexpr):
    """Adds a tile's parameter-gradient contributions ``V`` into this program's row of
    partial sums (``P + Row``, one value per channel), by channel: the program owns the
    row, so there is no race and the order is fixed. Tiles of several groups come only
    where the channel runs along the columns (PCHAN 2: rows of x, whose groups share
    their channels)."""
    W = tl.where(Mask, V, 0.0)
    C0 = tl.max(Chan0)
    if PCHAN == 1:
        Part = tl.sum(tl.sum(W, axis=2), axis=0)
        I = tl.max(tl.max(Ia, axis=2), axis=0)
        Ok = I < A
        tl.store(P + Row + C0 + I, tl.load(P + Row + C0 + I, mask=Ok, other=0.0) + Part, mask=Ok)
    elif PCHAN == 2:
        Part = tl.sum(tl.sum(W, axis=1), axis=0)
        I = tl.max(tl.max(Ib, axis=1), axis=0)
        Ok = I < B
        tl.store(P + Row + C0 + I, tl.load(P + Row + C0 + I, mask=Ok, other=0.0) + Part, mask=Ok)
    else:
        tl.store(P + Row + C0, tl.load(P + Row + C0) + tl.sum(W))


@triton.jit
def sum_rows_kernel(P, Out, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Out[c] = sum over r of P[r, c] (float32 sums, stored in Out's dtype): the second
    kernel of a backward, reducing the programs' partial parameter sums."""
    Cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    Ok = Cols < C
    Acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for R0 in range(0, R, BLOCK_R):
        Rows = R0 + tl.arange(0, BLOCK_R)[:, None]
        M = (Rows < R) & Ok[None, :]
        Acc += tl.load(P + tl.cast(Rows, tl.int64) * C + Cols[None, :], mask=M, other=0.0)
    tl.store(Out + Cols, tl.sum(Acc, axis=0).to(Out.dtype.element_ty), mask=Ok)
