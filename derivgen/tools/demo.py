"""``python -m derivgen.tools.demo``: a small CNN (BatchNorm2d, GroupNorm, InstanceNorm2d)
and a transformer block (LayerNorm, RMSNorm) trained with torch.nn's norms and, side by
side, after ``derivgen.torch.convert``: the losses step by step, how far apart the final
parameters are, and the time of each run."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch
from torch import nn

import derivgen.torch as dt


class CNN(nn.Module):
    """A small image classifier with a BatchNorm2d, a GroupNorm and an InstanceNorm2d."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.GroupNorm(4, 16),
            nn.ReLU(),
            nn.Conv2d(16, 8, 3, padding=1),
            nn.InstanceNorm2d(8, affine=True),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class scores of a batch of 3-channel images."""
        return self.net(x)


class Block(nn.Module):
    """A pre-norm transformer block (LayerNorm, attention, RMSNorm, MLP) and a classifier head."""

    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.RMSNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class scores of a batch of sequences (mean over the sequence, then the head)."""
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.ln2(x))
        return self.head(x.mean(1))


def train(model: nn.Module, xs: list[torch.Tensor], ts: list[torch.Tensor], steps: int) -> tuple[list[float], float]:
    """``steps`` SGD steps of cross entropy over the batches in turn: the losses and the seconds taken."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    t0 = time.perf_counter()
    for k in range(steps):
        x, t = xs[k % len(xs)], ts[k % len(ts)]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), t)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, time.perf_counter() - t0


def _worst(a_model: nn.Module, b_model: nn.Module) -> float:
    """The largest difference of two models' floating-point state, relative to each tensor's largest value."""
    return max(
        ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        for a, b in zip(a_model.state_dict().values(), b_model.state_dict().values())
        if a.is_floating_point()
    )


def run(name: str, make: Callable[[], nn.Module], shape: tuple[int, ...], steps: int = 20) -> float:
    """Train a model with torch.nn's norms and its converted twin side by side and print the
    comparison; returns the largest relative difference of the two after training in float64."""
    torch.manual_seed(0)
    ref = make()
    ours = dt.convert(copy.deepcopy(ref))
    ref64, ours64 = copy.deepcopy(ref).double(), copy.deepcopy(ours).double()
    swapped = sorted({type(m).__name__ for m in ours.modules() if type(m).__module__ == "derivgen.torch.nn"})
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(shape, generator=g) for _ in range(4)]
    ts = [torch.randint(0, 10, (shape[0],), generator=g) for _ in range(4)]
    l_ref, t_ref = train(ref, xs, ts, steps)
    l_ours, t_ours = train(ours, xs, ts, steps)
    print(f"== {name}: {steps} SGD steps, float32, input {tuple(shape)}; converted: {', '.join(swapped)}")
    print("  step   torch.nn loss   derivgen loss")
    for k in range(0, steps, 4):
        print(f"  {k + 1:4d}   {l_ref[k]:13.7f}   {l_ours[k]:13.7f}")
    print(f"  {steps:4d}   {l_ref[-1]:13.7f}   {l_ours[-1]:13.7f}")
    print(
        f"  final parameters and buffers, largest difference relative to each tensor's largest value: "
        f"{_worst(ours, ref):.1e} (float32 rounding, grown by 20 steps of training)"
    )
    train(ref64, [x.double() for x in xs], ts, steps)
    train(ours64, [x.double() for x in xs], ts, steps)
    worst = _worst(ours64, ref64)
    print(f"  the same in float64: {worst:.1e}")
    print(f"  time: torch.nn {t_ref:.2f} s, derivgen {t_ours:.2f} s (derivgen's first steps include compiling kernels)")
    return worst


def main() -> None:
    """Run the demo on both models; exit with an error if the float64 runs drifted apart."""
    worst = max(run("small CNN", CNN, (16, 3, 16, 16)), run("transformer block", Block, (8, 12, 64)))
    if worst > 1e-10:
        raise SystemExit(f"the converted model drifted from torch.nn's in float64: {worst:.2e}")


if __name__ == "__main__":
    main()
