"""The peers, in PyTorch: the same MLP and CNN, plain and per-example.

Needs the ``bench-torch`` extra (``pip install -e ".[bench-torch]"``:
torch, Opacus, BackPACK). Methods, each timed against ``torch_plain`` in the
same run:

* ``torch_plain``: forward, summed cross-entropy, ``loss.backward()``.
* ``opacus_ghost_norms``: the model wrapped in Opacus'
  ``GradSampleModuleFastGradientClipping(use_ghost_clipping=True,
  loss_reduction="sum")``; one backward gives the grads and, from the hooks,
  the per-example gradient norms (``get_norm_sample()``). Layers without a
  ghost-norm rule (conv, GroupNorm) materialise per-example gradients.
* ``backpack_l2``: ``backpack.extend`` model and loss, one backward under
  ``backpack(BatchL2Grad())``; norms from ``sum(p.batch_l2)``.
* ``backpack_gram``: one backward under ``backpack(BatchGrad())``, then the
  Gram as ``sum_p einsum("i...,j...->ij", p.grad_batch, p.grad_batch)``.
* ``opacus_dp_ghost``: Opacus' DP step with ghost clipping, as its
  ``DPTensorFastGradientClipping.backward`` runs it: a first backward for
  the norms (hooks), ``get_clipping_coef()``, then a second backward of
  ``sum_i c_i l_i`` with the hooks off. Gives the clipped sum
  ``sum_i min(1, C/|g_i|) g_i`` in ``p.grad``.
* ``opacus_dp_per_sample``: Opacus' classic DP-SGD: ``GradSampleModule``
  materialises ``p.grad_sample`` in one backward, and ``DPOptimizer``'s
  ``clip_and_accumulate()`` clips and sums them into ``p.summed_grad``.

Both clip at :data:`benchmarks.dp_methods.CLIP`, all-layer, without noise,
and are checked against the clipped sum of ``torch.func.vmap(grad)``.

The architecture mirrors :mod:`benchmarks.models` (channels-first for the
CNN, same SAME-padding output sizes); the data are the same arrays.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from typing import Callable

import numpy as np

# Before torch loads OpenMP: worker threads sleep instead of spinning at
# barriers. On a shared 2-core machine a spinning thread whose partner was
# descheduled made a 3 ms MLP step take 50 ms (and JAX's blocks, timed in
# between, suffered too). Set OMP_WAIT_POLICY yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

TORCH_METHODS = ("torch_plain", "opacus_ghost_norms", "backpack_l2",
                 "backpack_gram", "opacus_dp_ghost", "opacus_dp_per_sample")
#: The DP steps among them: each returns the clipped gradient sum.
TORCH_DP_METHODS = ("opacus_dp_ghost", "opacus_dp_per_sample")
TORCH_MODELS = ("mlp", "cnn")
SKIP_REASON = 'skipped: install .[bench-torch]'

#: What each peer gives, for the table.
GIVES = {"torch_plain": "loss + grads",
         "opacus_ghost_norms": "grads + norms",
         "backpack_l2": "grads + norms",
         "backpack_gram": "grads + full Gram",
         "opacus_dp_ghost": "clipped grad sum (2 backward)",
         "opacus_dp_per_sample": "clipped grad sum (B x P)"}


def available() -> bool:
  try:
    import torch  # pylint: disable=g-import-not-at-top,unused-import
    import opacus  # pylint: disable=g-import-not-at-top,unused-import
    import backpack  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return False
  return True


def versions() -> dict:
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  out = {}
  for key, dist in (("torch", "torch"), ("opacus", "opacus"),
                    ("backpack", "backpack-for-pytorch")):
    try:
      out[key] = metadata.version(dist)
    except metadata.PackageNotFoundError:
      out[key] = None
  return out


def _model(name: str, hidden=(512, 512), input_dim=784, classes=10):
  import torch.nn as nn  # pylint: disable=g-import-not-at-top
  from benchmarks import models  # pylint: disable=g-import-not-at-top
  if name == "mlp":
    sizes = [input_dim, *hidden, classes]
    layers = []
    for i, (n, m) in enumerate(zip(sizes[:-1], sizes[1:])):
      layers.append(nn.Linear(n, m))
      if i < len(sizes) - 2:
        layers.append(nn.ReLU())
    return nn.Sequential(*layers)
  if name == "cnn":
    layers, cin = [], 3
    for channels, stride in models.CNN_BLOCKS:
      layers += [nn.Conv2d(cin, channels, 3, stride=stride, padding=1),
                 nn.GroupNorm(models.CNN_GROUPS, channels), nn.ReLU()]
      cin = channels
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)
  raise ValueError(f"No torch version of model {name!r}.")


def _data(bench):
  import torch  # pylint: disable=g-import-not-at-top
  x, y = (np.array(a) for a in bench.batch)  # writable copies
  if x.ndim == 4:  # NHWC -> NCHW
    x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
  return torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))


def build(bench, method: str, hidden=(512, 512)) -> Callable[[], object]:
  """Returns a zero-argument callable running one step of ``method``.

  Raises:
    Exception: whatever the peer raises for a model it does not support.
  """
  import torch  # pylint: disable=g-import-not-at-top
  import torch.nn.functional as F  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  base = _model(bench.name, hidden=hidden)
  base.train()
  x, y = _data(bench)

  if method == "torch_plain":
    model = copy.deepcopy(base)

    def step():
      model.zero_grad(set_to_none=True)
      loss = F.cross_entropy(model(x), y, reduction="sum")
      loss.backward()
      return loss
    return step

  if method == "opacus_ghost_norms":
    from opacus.grad_sample import GradSampleModuleFastGradientClipping  # pylint: disable=g-import-not-at-top
    gsm = GradSampleModuleFastGradientClipping(
        copy.deepcopy(base), batch_first=True, loss_reduction="sum",
        use_ghost_clipping=True, max_grad_norm=1.0)
    gsm.train()

    def step():
      gsm.zero_grad(set_to_none=True)
      loss = F.cross_entropy(gsm(x), y, reduction="sum")
      loss.backward()
      return gsm.get_norm_sample()
    return step

  if method in ("backpack_l2", "backpack_gram"):
    from backpack import backpack, extend  # pylint: disable=g-import-not-at-top
    from backpack.extensions import BatchGrad, BatchL2Grad  # pylint: disable=g-import-not-at-top
    model = extend(copy.deepcopy(base))
    lossf = extend(torch.nn.CrossEntropyLoss(reduction="sum"))
    params = [p for p in model.parameters() if p.requires_grad]

    if method == "backpack_l2":
      def step():
        model.zero_grad(set_to_none=True)
        loss = lossf(model(x), y)
        with backpack(BatchL2Grad()):
          loss.backward()
        return torch.sqrt(sum(p.batch_l2 for p in params))
      return step

    def step():  # pylint: disable=function-redefined
      model.zero_grad(set_to_none=True)
      loss = lossf(model(x), y)
      with backpack(BatchGrad()):
        loss.backward()
      gram = 0
      for p in params:
        gb = p.grad_batch
        gram = gram + torch.einsum("i...,j...->ij", gb, gb)
        p.grad_batch = None
      return gram
    return step

  if method == "opacus_dp_ghost":
    from opacus.grad_sample import GradSampleModuleFastGradientClipping  # pylint: disable=g-import-not-at-top
    gsm = GradSampleModuleFastGradientClipping(
        copy.deepcopy(base), batch_first=True, loss_reduction="sum",
        use_ghost_clipping=True, max_grad_norm=_clip())
    gsm.train()

    def step():  # pylint: disable=function-redefined
      gsm.zero_grad(set_to_none=True)
      per = F.cross_entropy(gsm(x), y, reduction="none")
      per.sum().backward(retain_graph=True)
      coeff = gsm.get_clipping_coef()
      gsm.zero_grad(set_to_none=True)
      gsm.disable_hooks()
      torch.sum(coeff * per).backward()
      gsm.enable_hooks()
      return [p.grad for p in gsm.parameters()]
    return step

  if method == "opacus_dp_per_sample":
    from opacus import GradSampleModule  # pylint: disable=g-import-not-at-top
    from opacus.optimizers import DPOptimizer  # pylint: disable=g-import-not-at-top
    gsm = GradSampleModule(copy.deepcopy(base), batch_first=True,
                           loss_reduction="sum")
    gsm.train()
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.0),
                      noise_multiplier=0.0, max_grad_norm=_clip(),
                      expected_batch_size=x.shape[0], loss_reduction="sum")

    def step():  # pylint: disable=function-redefined
      opt.zero_grad(set_to_none=True)
      F.cross_entropy(gsm(x), y, reduction="sum").backward()
      opt.clip_and_accumulate()
      return [p.summed_grad for p in gsm.parameters()]
    return step

  raise ValueError(f"Unknown torch method {method!r}; expected one of "
                   f"{TORCH_METHODS}.")


def reference_per_example_grads(bench, hidden=(512, 512)) -> list[np.ndarray]:
  """Per-example gradients ``[B, *p.shape]`` of each parameter, in
  ``model.parameters()`` order, by ``torch.func.vmap(grad)``, float64."""
  import torch  # pylint: disable=g-import-not-at-top
  import torch.nn.functional as F  # pylint: disable=g-import-not-at-top
  from torch.func import functional_call, grad, vmap  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  model = _model(bench.name, hidden=hidden)
  x, y = _data(bench)
  params = {k: v.detach() for k, v in model.named_parameters()}

  def loss_one(p, xi, yi):
    out = functional_call(model, p, (xi[None],))
    return F.cross_entropy(out, yi[None], reduction="sum")
  per = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
  return [g.double().numpy() for g in per.values()]


def reference_sq_norms(bench, hidden=(512, 512)) -> np.ndarray:
  """Squared per-example gradient norms by ``torch.func.vmap(grad)``."""
  return _sq_norms_of(reference_per_example_grads(bench, hidden))


def _clip() -> float:
  from benchmarks import dp_methods  # pylint: disable=g-import-not-at-top
  return dp_methods.CLIP


def reference_clipped_sum(bench, hidden=(512, 512)) -> list[np.ndarray]:
  """``sum_i min(1, C/|g_i|) g_i`` per parameter, from
  ``torch.func.vmap(grad)``, in float64."""
  per = reference_per_example_grads(bench, hidden)
  norms = np.sqrt(_sq_norms_of(per))
  c = np.minimum(1.0, _clip() / np.maximum(norms, 1e-30))
  return [np.tensordot(c, g, axes=1) for g in per]


def _sq_norms_of(per) -> np.ndarray:
  """``[B]`` squared norms of per-example gradients ``[B, ...]`` (a list)."""
  return sum((g.reshape(g.shape[0], -1) ** 2).sum(1) for g in per)


def check(bench, method: str, out, hidden=(512, 512), rtol=1e-3):
  """None when a peer's norms (Gram diagonal, clipped sum) match the
  reference."""
  if method == "torch_plain":
    return None
  if method in TORCH_DP_METHODS:
    ref = reference_clipped_sum(bench, hidden)
    got = [g.detach().double().numpy() for g in out]
    err = max(float(np.abs(a - b).max()) for a, b in zip(got, ref)) / max(
        max(float(np.abs(b).max()) for b in ref), 1e-30)
    if len(got) != len(ref) or not np.isfinite(err) or err > rtol:
      return f"wrong result: max relative error {err:.2e} against vmap(grad)"
    return None
  ref = reference_sq_norms(bench, hidden)
  got = out.detach().numpy().astype(np.float64)
  if method == "backpack_gram":
    got = np.diagonal(got)
  else:
    got = got ** 2
  err = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))
  if not np.isfinite(err) or err > rtol:
    return f"wrong result: max relative error {err:.2e} against vmap(grad)"
  return None


@contextlib.contextmanager
def _silenced_fds():
  """Sends the C++ profiler's own prints on fds 1 and 2 to /dev/null."""
  sys.stdout.flush()
  sys.stderr.flush()
  saved = [os.dup(1), os.dup(2)]
  null = os.open(os.devnull, os.O_WRONLY)
  try:
    os.dup2(null, 1)
    os.dup2(null, 2)
    yield
  finally:
    os.dup2(saved[0], 1)
    os.dup2(saved[1], 2)
    for fd in (*saved, null):
      os.close(fd)


def peak_bytes(step: Callable[[], object]) -> float | None:
  """Peak bytes allocated during one step above its start (torch profiler).

  The running sum of the profiler's CPU allocation events (each op's own
  allocations and frees, in time order). Not the same measure as XLA's
  compiled temp size: compare torch rows with torch rows only.
  """
  try:
    from torch.profiler import ProfilerActivity, profile  # pylint: disable=g-import-not-at-top
    step()
    with _silenced_fds():
      with profile(activities=[ProfilerActivity.CPU],
                   profile_memory=True) as p:
        step()
    events = sorted((e.time_range.start, e.self_cpu_memory_usage)
                    for e in p.events() if e.self_cpu_memory_usage)
    if not events:
      return None
    return float(max(0, np.cumsum([b for _, b in events]).max()))
  except Exception:  # pylint: disable=broad-except
    return None
