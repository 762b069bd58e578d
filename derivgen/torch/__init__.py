"""derivgen layers in PyTorch: operators, autograd, and drop-in ``torch.nn`` modules.

    import derivgen.torch as dt
    model = dt.convert(model)                 # torch.nn norms -> derivgen twins, same state
    model = dt.convert(model, import_unknown=True, example_inputs=(x,))  # + leaves that import
    norm = dt.LayerNorm(1024)                 # the torch.nn.LayerNorm constructor
    mine = dt.Module("my_norm.toml", 256)     # any spec, as a module
    dt.build("layernorm", "my_norm.toml")     # compile ahead what first use compiles
    y, h = dt.FusedAddRMSNorm(4096)(x, residual)   # fused residual add + RMSNorm (vLLM, Liger)
    y = dt.RMSNormGated(1024, group_size=256, norm_before_gate=False)(x, z)   # Mamba-2's

On the CPU the layers run derivgen's compiled C kernels; on any other device (CUDA,
MPS, XPU), under torch.func transforms, and within ``with dt.portable():``, the
generated PyTorch closed forms (:mod:`derivgen.torch.generic`).

torch is an optional dependency (``pip install torch ninja``, or the ``torch`` extra
of derivgen's source, which pins the CPU wheel the tests run). See :mod:`derivgen.torch.ops` for the operators and
:mod:`derivgen.torch.nn` for the modules.
"""

try:
    import torch as _torch  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "derivgen.torch needs PyTorch, an optional dependency: pip install torch ninja "
        "(or the torch extra of derivgen's source, pip install '/path/to/derivgen[torch]': "
        "torch==2.13.0, the CPU wheel)"
    ) from e

from derivgen.torch.ahead import build
from derivgen.torch.fused import FusedAddRMSNorm, RMSNormGated
from derivgen.torch.generic import portable
from derivgen.torch.nn import (
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    ConvertReport,
    GroupNorm,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    LayerNorm,
    Module,
    OnlineLayerNorm,
    RMSNorm,
    SyncBatchNorm,
    convert,
    function,
)
from derivgen.torch.ops import layer

__all__ = [
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "ConvertReport",
    "FusedAddRMSNorm",
    "GroupNorm",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "LayerNorm",
    "Module",
    "OnlineLayerNorm",
    "RMSNorm",
    "RMSNormGated",
    "SyncBatchNorm",
    "build",
    "convert",
    "function",
    "layer",
    "portable",
]
