"""The PyTorch importer's whole layers (:mod:`derivgen.spec.from_torch`): the operations core
ATen keeps whole or decomposes into shapes the spec language says another way, read as the
catalogue's and the zoo's specs:

* ``native_layer_norm``, ``native_group_norm``: layer and group normalization;
* ``_native_batch_norm_legit_functional`` (batch norm in training mode, its running-buffer
  updates returned as outputs), ``_native_batch_norm_legit_no_training`` (eval mode, reading
  the buffers): batch normalization with ``[buffers]`` and their momentum update, and an eval
  mode whose statistics are the buffers, as the catalogue's ``batchnorm``;
* ``_native_batch_norm_legit`` without statistics: batch norm without running buffers, or,
  applied to x viewed as ``(1, N*C, *spatial)`` with repeated parameters, instance norm;
* ``_softmax``, ``_log_softmax``: the zoo's softmax and log-softmax (``m = max(x)``,
  ``s = sum(exp(x - m))``);
* ``local_response_norm``'s decomposition (x**2 viewed with a unit axis, zero padded along the
  channels, averaged by ``avg_pool2d``/``avg_pool3d``): ``window(x**2, size)/size``, as the
  zoo's ``lrn``.

Each function takes the walk (:class:`~derivgen.spec.torch_graph._Walker`) and the node.
"""

from __future__ import annotations

from typing import Any

from derivgen.spec.torch_ops import _ADD, _ATOM, _ELEM, _GROUP, _MUL, _V, _Layout, _wrap


def named_stat(w: Any, text: str, prec: int, preferred: str) -> _V:
    """A statistic a whole layer computes, named as the hand-written spec names it (not after
    the source line, which assigns the layer's output)."""
    name = w.fresh(preferred)
    w.st.statistics.append((name, text))
    return _V(name, _ATOM, _GROUP, name=name)


def _moments(w: Any, node: Any, eps: float, x: str = "x") -> tuple[_V, _V, _V]:
    mean = named_stat(w, f"mean({x})", _ATOM, "mean")
    var = named_stat(w, f"mean(({x} - {mean.text})**2)", _ATOM, "var")
    rstd = named_stat(w, f"1/sqrt({var.text} + {w.option(float(eps), True).text})", _MUL, "rstd")
    return mean, var, rstd


def _affine(w: Any, node: Any, mean: _V, rstd: _V, weight: Any, bias: Any, x: str = "x") -> _V:
    name = w.fresh(f"{x}hat")
    w.st.normalized = (name, f"({x} - {mean.text})*{rstd.text}")
    y = _V(name, _ATOM, _ELEM, name=name)
    if weight is not None:
        y = _V(f"{w.param_arg(node, weight).text}*{y.text}", _MUL, _ELEM)
    if bias is not None:
        y = _V(f"{y.text} + {w.param_arg(node, bias).text}", _ADD, _ELEM)
    return y


def layer_or_group_norm(w: Any, node: Any, op: str) -> tuple:
    args = node.args
    x = w.val(node, args[0])
    core = w.st.value[0] if w.st.value else None  # the value a residual add made (flash-attn's prenorm)
    if x.text not in ("x", core):
        raise w.refuse(node, w.display(node), "a layer or group norm of something other than x")
    if op == "native_layer_norm":
        shape, weight, bias, eps = args[1], args[2], args[3], args[4]
        k = len(shape)
        w.reduced(node, tuple(range(w.st.ndim - k, w.st.ndim)), True)
    else:
        weight, bias, _n, _c, _hw, groups, eps = args[1:8]
        if w.st.layout.dims is not None:
            raise w.refuse(node, w.display(node), "a group norm beside other reductions")
        w.st.layout = _Layout("channels", "group", 1, (-1,))
        w.st.notes.append(f"num_groups = {groups}: the generated forward takes it as its num_groups= argument")
    mean, _var, rstd = _moments(w, node, eps, x.text)
    y = _affine(w, node, mean, rstd, weight, bias, x.text)
    y.view = x.view  # timm's LayerNorm2d: the layer norm of x permuted to channels last
    return (y, mean, rstd)


def buffer_update(w: Any, node: Any, target: str) -> bool:
    """Is the mutation ``node`` of buffer ``target`` a batch norm's running-statistic
    update (its output 3 or 4) or num_batches_tracked + 1?"""
    if node.op != "call_function":
        return False
    if w.op_name(node)[1] == "_to_copy" and set(node.kwargs) <= {"dtype", "layout"}:  # back to the buffer's dtype
        node = node.args[0]
    if w.op_name(node)[1] == "getitem":
        src = node.args[0]
        return (
            getattr(src, "op", None) == "call_function"
            and w.op_name(src)[1] == "_native_batch_norm_legit_functional"
            and node.args[1] in (3, 4)
        )
    counter = target.split(".")[-1] == "num_batches_tracked" and w.op_name(node)[1] == "add"
    if counter and node.args[1] == 1 and getattr(node.args[0], "op", None) == "placeholder":
        w.counters.add(node.name)
        return True
    return False


def momentum_option(w: Any, value: float) -> str:
    name = "momentum" if w.ok("momentum") else w.fresh(None, "momentum")
    if name not in w.st.options:
        w.st.taken.add(name)
        w.st.options[name] = {"default": value, "min": 0, "max": 1}
    return name


def size_option(w: Any, size: int) -> str:
    """The window's size, an integer option named after the module's attribute."""
    attrs = [a for a, v in vars(w.module).items() if type(v) is int and v == size and not a.startswith("_")]
    name = "size" if "size" in attrs or not attrs else attrs[0].lower()
    if name in w.st.options:
        return name
    if not w.ok(name):
        name = w.fresh(None, "size")
    w.st.taken.add(name)
    w.st.options[name] = {"default": size, "min": 1, "integer": True}
    return name


def buffer_init(w: Any, v: _V, default: float) -> float:
    """A running buffer's init: its value where every element has the same, else PyTorch's."""
    flat = w.module.get_buffer(v.tag[1]).detach().reshape(-1).double()
    if flat.numel() and bool(w.torch.all(flat == flat[0])):
        value = float(flat[0])
        return int(value) if value.is_integer() else value
    return int(default)


def instance_view(w: Any, node: Any, v: _V, shape: tuple[int, ...]) -> _V | None:
    """x viewed as one sample of N*C channels, as instance norm passes it to batch norm."""
    st = w.st
    if v.tag is not None or v.text != "x" or st.ndim < 3:
        return None
    if shape != (1, st.shape[0] * st.shape[1], *st.shape[2:]):
        return None
    if all(w.op_name(u)[1] == "_native_batch_norm_legit" for u in node.users):
        return _V("x", _ATOM, _ELEM, affine=True, tag=("instance",))
    return None


def batch_norm(w: Any, node: Any, op: str) -> tuple:
    """Batch norm (training mode with running buffers, eval mode, or without buffers) and
    instance norm (batch norm of x viewed as one sample of N*C channels)."""
    args = node.args
    x = w.values[args[0].name] if hasattr(args[0], "name") else None
    if x is None or x.text != "x" or x.level != _ELEM:
        raise w.refuse(node, "torch.batch_norm", "a batch or instance norm of something other than x")
    nd = w.st.ndim
    instance = x.tag == ("instance",)
    if x.tag is not None and not instance:
        raise w.refuse(node, "torch.batch_norm", "a batch norm of a reshaped x")
    if op == "_native_batch_norm_legit":  # no running statistics: (x, w, b, training, momentum, eps)
        weight, bias, training, _momentum, eps = args[1:6]
        buffers = None
    elif op == "_native_batch_norm_legit_functional":  # (x, w, b, rm, rv, training, momentum, eps)
        weight, bias, rm, rv, training, momentum, eps = args[1:8]
        buffers = (rm, rv)
    else:  # _no_training: (x, w, b, rm, rv, momentum, eps)
        weight, bias, rm, rv, momentum, eps = args[1:7]
        buffers, training = (rm, rv), False
    if not training and buffers is None:
        raise w.refuse(node, "torch.batch_norm", "eval mode without running statistics")
    dims = tuple(range(2, nd)) if instance else (0, *range(2, nd))
    if not dims:
        raise w.refuse(node, "torch.instance_norm", "an instance norm of an x without spatial axes")
    w.reduced(node, dims, True)
    if instance:  # not trailing: the parameters are per channel
        w.st.layout.kind, w.st.layout.reduce = "channels", "instance"
    mean, var, rstd = _moments(w, node, eps)
    w.st.min_group_size = 2  # as PyTorch: "Expected more than 1 value per channel when training"
    if buffers is not None:
        rm_v, rv_v = (w.values[b.name] for b in buffers)
        if (rm_v.tag or ("",))[0] != "buffer" or (rv_v.tag or ("",))[0] != "buffer":
            raise w.refuse(node, "torch.batch_norm", "running statistics that are not the module's buffers")
        mom = momentum_option(w, float(momentum))
        w.st.buffers[rm_v.name] = {
            "init": buffer_init(w, rm_v, 0.0),
            "update": f"(1 - {mom})*{rm_v.name} + {mom}*{mean.text}",
        }
        w.st.buffers[rv_v.name] = {
            "init": buffer_init(w, rv_v, 1.0),
            "update": f"(1 - {mom})*{rv_v.name} + {mom}*{var.text}*N/(N - 1)",
        }
        w.st.eval_statistics = [(mean.text, rm_v.name), (var.text, rv_v.name)]
        if not training:
            w.st.notes.append(
                "Traced in eval mode (normalizing with the running buffers); the spec has both modes: "
                "the generated forward's training=False is the traced one."
            )
    y = _affine(w, node, mean, rstd, weight, bias)
    done = _V("0", _ATOM, _GROUP, tag=("update",))  # the buffers' new values: the spec's [buffers]
    return (y, mean, rstd, done, done)


def softmax(w: Any, node: Any, op: str) -> _V:
    v = w.val(node, node.args[0])
    if v.level != _ELEM or v.tag is not None:
        raise w.refuse(node, w.display(node), "a softmax of something other than element values of x")
    w.reduced(node, (node.args[1],), True)
    m = named_stat(w, f"max({v.text})", _ATOM, "m")
    s = named_stat(w, f"sum(exp({_wrap(v, _ADD)} - {m.text}))", _ATOM, "s")
    if op == "_softmax":
        return _V(f"exp({_wrap(v, _ADD)} - {m.text})/{s.text}", _MUL, _ELEM)
    return _V(f"{_wrap(v, _ADD)} - {m.text} - log({s.text})", _ADD, _ELEM)


# -- local response normalization: x**2 viewed (N, 1, C, ...), padded along C, averaged -------------
def lrn_view(w: Any, node: Any, v: _V, shape: tuple[int, ...]) -> _V | None:
    """The view of an element value as (N, 1, C, *rest) local_response_norm pools over."""
    st = w.st
    n, c = st.shape[0], st.shape[1] if st.ndim > 1 else 0
    if v.tag is None and st.ndim >= 3 and len(shape) in (4, 5) and shape[:3] == (n, 1, c):
        users = [u for u in node.users if w.op_name(u)[1] == "constant_pad_nd"]
        if users and len(users) == len(node.users):
            return _V(v.text, v.prec, _ELEM, tag=("channel_view",))
    return None


def lrn_pad(w: Any, node: Any) -> _V:
    v = w.values[node.args[0].name]
    pad = list(node.args[1])
    value = node.args[2] if len(node.args) > 2 else 0.0
    if v.tag != ("channel_view",) or value != 0 or len(pad) < 2 or any(pad[:-2]):
        raise w.refuse(node, "torch.constant_pad_nd", "a padding changes the group's shape")
    return _V(v.text, v.prec, _ELEM, tag=("channel_pad", pad[-2], pad[-1]))


def lrn_pool(w: Any, node: Any, op: str) -> _V:
    """The average over size channels, the padding counted: window(v, size)/size."""
    v = w.values[node.args[0].name]
    args = list(node.args) + [None] * 8
    kernel, stride, padding = list(args[1]), list(args[2] or args[1]), list(args[3] or [0])
    ceil_mode, count_pad, divisor = args[4] or False, True if args[5] is None else args[5], args[6]
    size = kernel[0]
    ok = (
        v.tag is not None
        and v.tag[0] == "channel_pad"
        and all(k == 1 for k in kernel[1:])
        and all(s == 1 for s in stride)
        and not any(padding)
        and not ceil_mode
        and count_pad
        and divisor is None
        and v.tag[1:] == (size // 2, (size - 1) // 2)
    )
    if not ok:
        raise w.refuse(node, f"torch.{op}", "a pooling other than local_response_norm's window over the channels")
    w.reduced(node, (1,), True)
    name = size_option(w, size)
    return _V(f"window({v.text}, {name})/{name}", _MUL, _ELEM, tag=("channel_pooled",))
