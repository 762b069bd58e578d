"""The PyTorch importer's last steps (:mod:`derivgen.spec.from_torch`): the layout that the
reduced dimensions and the parameters' shapes imply, checked, and the spec the walk found
written as TOML text.
"""

from __future__ import annotations

import re
from typing import Any

from derivgen.spec.torch_ops import TorchImportError, _State


# -- layout ---------------------------------------------------------------------------------------
def _infer_layout(st: _State, fn_name: str) -> None:
    _infer_axes(st, fn_name)
    _tensor_shapes(st, fn_name)


def _tensor_shapes(st: _State, fn_name: str) -> None:
    """Each tensor beside x: x's shape, or one value per sample (and feature or channel), or
    per sample and position (channels), as the runtime takes them."""
    lay, xs = st.layout, st.shape
    if lay.kind == "trailing":
        k = lay.axes
        kinds = {xs: None, (xs[0], *xs[len(xs) - k :]): "sample"} if len(xs) > k + 1 else {xs: None}
    else:
        kinds = {xs: None, xs[:2]: "sample", (xs[0], 1, *xs[2:]): "position"}
    for name, shape in st.tensor_shapes.items():
        if shape not in kinds:
            said = ", ".join(str(s) for s in kinds)
            raise TorchImportError(
                f"{fn_name}: tensor {name} of shape {shape} for x of shape {xs}: a tensor beside x has one of "
                f"the shapes {said}"
            )
        if kinds[shape] is not None:
            st.tensors[name] = {"shape": kinds[shape], **st.tensors[name]}


def _infer_axes(st: _State, fn_name: str) -> None:
    lay = st.layout
    nd, shape = st.ndim, st.shape
    channel_params = {n: s for n, s in st.param_shapes.items() if st.params[n].get("shape") != "scalar"}
    if lay.kind == "channels" and lay.reduce in ("group", "instance"):  # a whole layer said which
        _check_channel_params(st, channel_params, fn_name)
        return
    dims = lay.dims
    if dims is None:  # elementwise: the parameters say which axes are features
        spans = {len(_strip(s)) for s in channel_params.values()}
        k = max(spans) if spans else 1
        dims = tuple(range(nd - k, nd))
    trailing = dims == tuple(range(nd - len(dims), nd)) and len(dims) < nd
    if trailing and nd > 2 and dims == tuple(range(2, nd)) and channel_params:
        # statistics over the space of (N, C, *S) with parameters per channel (timm's FRN):
        # a channel layout, not a trailing one whose parameters would span the space
        spans = all(tuple(_strip(s)) == tuple(shape[2:]) for s in channel_params.values())
        per_channel = all(tuple(_strip(s)) == (shape[1],) for s in channel_params.values())
        trailing = spans or not per_channel
    if trailing:
        k = len(dims)
        lay.kind, lay.axes = "trailing", k
        want = shape[nd - k :]
        for n, s in channel_params.items():
            if tuple(_strip(s)) != tuple(want) or len(s) > k and any(d != 1 for d in s[: len(s) - k]):
                raise TorchImportError(
                    f"{fn_name}: parameter {n} of shape {tuple(s)} does not span the normalized axes {tuple(want)}"
                )
        if channel_params and k > 1:
            lay.axes = k  # the parameters say it; kept for a reader
        return
    if nd < 2:
        raise TorchImportError(f"{fn_name}: reduces over all of a 1-d x; give x a batch axis")
    space = tuple(range(2, nd))
    kinds = {space: "instance", (0, *space): "batch", (1,): "position", tuple(range(nd)): "all"}
    if dims not in kinds or (kinds[dims] == "instance" and not space):
        raise TorchImportError(
            f"{fn_name}: reduces over dims {list(dims)} of a {nd}-d x: neither the trailing axes nor a "
            "channel layout's (space, batch and space, channels, all)"
        )
    lay.kind, lay.reduce = "channels", kinds[dims]
    _check_channel_params(st, channel_params, fn_name)


def _strip(s: tuple[int, ...]) -> tuple[int, ...]:
    s = tuple(s)
    while s and s[0] == 1:
        s = s[1:]
    return s


def _check_channel_params(st: _State, params: dict, fn_name: str) -> None:
    c = st.shape[1]
    for n, s in params.items():
        # (C,), (C, 1, 1) or (1, C, 1, 1)
        ok = _strip(s) and _strip(s)[0] == c and all(d == 1 for d in _strip(s)[1:])
        if not ok:
            raise TorchImportError(f"{fn_name}: parameter {n} of shape {tuple(s)} is not one value per channel ({c})")


# -- TOML ---------------------------------------------------------------------------------------
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _table(entry: dict) -> str:
    if not entry:
        return "{}"
    return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in entry.items()) + " }"


def _render(st: _State, name: str, origin: str, output: str) -> str:
    lay = st.layout
    lines = [f"# Imported by derivgen.from_torch from {origin} (torch.export, core ATen)."]
    if any(c == "float32" for c in st.casts):
        lines.append(
            "# The layer computes in float32 (x.float() ... .to(input_dtype) in its forward); the casts "
            "are dropped: the spec's arithmetic is the same in every dtype."
        )
    lines += [f"# {n}" for n in st.notes]
    lines += [
        f'name = "{name}"',
        f"title = {_toml_value(origin.split(' ')[0])}",
        f"summary = {_toml_value('Imported from ' + origin.split(' ')[0] + ' by derivgen.from_torch.')}",
        "",
        "[layout]",
        f'kind = "{lay.kind}"',
    ]
    if lay.kind == "channels":
        lines.append(f'reduce = "{lay.reduce}"')
    elif lay.axes != 1 and not any(e.get("shape") != "scalar" for e in st.params.values()):
        lines.append(f"axes = {lay.axes}")
    if st.params:
        lines += ["", "[params]"] + [f"{n} = {_table(e)}" for n, e in st.params.items()]
    if st.options:
        lines += ["", "[options]"] + [f"{n} = {_table(e)}" for n, e in st.options.items()]
    if st.tensors:
        lines += ["", "[tensors]"] + [f"{n} = {_table(e)}" for n, e in st.tensors.items()]
    if st.value:
        lines += ["", "[values]", f"{st.value[0]} = {_toml_value(st.value[1])}"]
    if st.statistics:
        lines += ["", "[statistics]"] + [f"{n} = {_toml_value(e)}" for n, e in st.statistics]
    if st.buffers:
        lines += ["", "[buffers]"] + [f"{n} = {_table(e)}" for n, e in st.buffers.items()]
    if st.min_group_size:
        lines += ["", "[modes.train]", f"min_group_size = {st.min_group_size}"]
    if st.eval_statistics:
        lines += ["", "[modes.eval.statistics]"] + [f"{n} = {_toml_value(e)}" for n, e in st.eval_statistics]
    if st.normalized:
        lines += ["", "[normalized]", f'name = "{st.normalized[0]}"', f"expr = {_toml_value(st.normalized[1])}"]
    lines += ["", "[output]", f"y = {_toml_value(output)}"]
    lines += [f"{n} = {_toml_value(e)}" for n, e in st.outputs] + [""]
    return "\n".join(lines)


def _snake(name: str) -> str:
    s = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
    s = re.sub(r"[^a-z0-9_]", "_", s).strip("_")
    if not s or not s[0].isalpha():
        s = "layer_" + s
    return s[:31]
