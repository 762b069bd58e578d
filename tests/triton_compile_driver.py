"""Compiles the generated Triton kernels of the specs given (catalogue or zoo names, or spec
files) for a CUDA target (sm_90) without a GPU: Triton's front end (the types of every
statement), its passes and ptxas, with the kernels' run-time arguments as a launch passes
them, one tile per group and swept in tiles. Run in its own process (see
tests/triton/test_triton_window.py): Triton's interpreter, which the tests' process uses
where there is no CUDA device, must be off before Triton is imported. Prints one line per
kernel and exits 1 on the first that fails."""

import importlib.util
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from derivgen.api import load_spec, materialize

POINTERS = {"x": "X_Ptr", "y": "Y_Ptr", "dy": "Dy_Ptr", "dx": "Dx_Ptr"}


def module(spec):
    root, _ = materialize(spec, "triton")
    loader = importlib.util.spec_from_file_location(f"compiled_{spec.name}", root / f"{spec.name}.py")
    mod = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(mod)
    return mod


def signature(roles) -> dict:
    """The kernel's leading arguments' types by name (derivgen.triton.launch._kernel_args)."""
    sig = {}
    for role, n in roles:
        if role == "option":
            sig[n] = "fp32"
        elif role == "input":
            sig[f"{n}_Ptr"], sig[f"{n}_Stride"] = "*fp32", "i32"
        elif role == "mask":
            sig[f"{n}_Lead"] = "i32"
        elif role == "dparam":
            sig[f"{n}_Part"] = "*fp32"
        elif role == "dinput":
            sig[f"{n}_Din"] = "*fp32"
        else:
            sig[POINTERS.get(role, f"{n}_Ptr")] = "*fp32"
    return sig


def main(names) -> int:
    target = GPUTarget("cuda", 90, 32)
    for name in names:
        spec = load_spec(name)
        mod = module(spec)
        for mode, kernels in mod.KERNELS.items():
            for kernel, role in zip(kernels, ("forward", "backward")):
                sig = signature(mod.ARGS[mode][role])
                for one_pass in (True, False):
                    const = {"ROWS": 4 if one_pass else 1, "BLOCK_A": 1, "BLOCK_B": 64, "ONE_PASS": one_pass}
                    const.update({"PCHAN": 2, "UPDATE": False})
                    names_ = kernel.arg_names
                    full = {a: sig.get(a, "constexpr" if a in const else "i32") for a in names_}
                    src = ASTSource(kernel, full, {(names_.index(k),): v for k, v in const.items() if k in names_})
                    what = f"{spec.name} {mode} {role} {'one pass' if one_pass else 'tiles'}"
                    try:
                        triton.compile(src, target=target)
                    except Exception as e:  # noqa: BLE001  (reported, then the driver fails)
                        print(f"{what}: FAILED {type(e).__name__}: {e}")
                        return 1
                    print(f"{what}: compiled")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
