"""The one cost model: which exact method computes a layer's Gram.

Each tracked layer kind has more than one exact way to form its Gram (or its
diagonal); which is cheapest depends on the shapes, known only in the
backward rule, after every ``vmap`` has been batched. A Gram op consults this
module once per application, with the sizes it sees and its
:class:`~gram_haiku._src.compute.plan.Plan`'s mode, strategy and memory budget, and
passes the answer to its kernels.

Counts are multiply-adds (gathers and scatters weighted by
:data:`GATHER_WEIGHT`); under ``shard_map`` each byte gathered from another
device adds :data:`COMM_FLOPS_PER_BYTE`. A method whose intermediates would
exceed the memory budget is never chosen by ``"auto"``; the ghost methods
are blocked and always fit.

Sources: Goodfellow (2015), "Efficient per-example gradient computations";
Li et al. (2022), "Large language models can be strong differentially
private learners" (ghost clipping); Bu et al. (2022), "Scalable and
efficient training of large convolutional neural networks with differential
privacy" (the per-layer choice between ghost norms and materialised
per-example gradients).
"""

from __future__ import annotations

import math
from typing import Literal

from gram_haiku._src.compute.plan import DEFAULT_MEMORY_BUDGET_BYTES

#: Linear layers (and each feature group of a convolution).
LinearMethod = Literal["ghost", "materialize"]
#: Convolutions: per group by the ghost method, per-example gradients of
#: every group at once, or materialised one group at a time.
ConvMethod = Literal["ghost", "materialize", "materialize_by_group"]
#: Embedding lookups (see :mod:`gram_haiku._src.ops.embed`).
EmbedMethod = Literal["ghost", "dense", "segment"]

#: Multiply-adds that one gathered byte is counted as, in the cost of a
#: Gram whose columns come from other devices (``shard_map``): a rough ratio
#: of a device's arithmetic rate to its interconnect bandwidth. The choice
#: between methods only moves when their FLOPs are within this factor of
#: their traffic.
COMM_FLOPS_PER_BYTE = 16

#: Gathers and scatters cost more than a matmul multiply-add.
GATHER_WEIGHT = 4

#: The size a symbolic dimension is taken to be by every choice made from
#: sizes (the method, and the blocks that keep a kernel within the memory
#: budget): a batch or sequence length unknown when tracing (``jax.export``
#: with ``symbolic_shape``), which the one program then serves at every
#: size. Every method and block size is exact, so this moves only the time
#: and memory; the budget holds up to this many.
SYMBOLIC_SIZE = 1024


#: Platforms where the sequence ghost Gram of a linear map (the
#: ``(B, B)`` Gram, equation (1) of :mod:`gram_haiku._src.compute.kernels`) runs
#: as the Pallas kernel of :mod:`gram_haiku._src.compute.pallas_ghost` rather than
#: as XLA's blocked ops. Measured on one TPU v5e chip (2026-12-06, jax
#: 0.10.2, ``python -m benchmarks.pallas_ghost``; float32, the layers of a
#: ViT-S/4, a GPT-style decoder and a T = 1024 sequence): the kernel took
#: 1.4x to 2.5x less time at ``DEFAULT`` precision and 1.5x to 2.7x less at
#: ``HIGHEST``, with the same error. Its ghost norms were not faster (0.7x
#: to 1.2x), so the norms stay on XLA's path everywhere. Elsewhere Pallas
#: runs only in interpret mode (the tests put ``"cpu"`` here).
PALLAS_GHOST_GRAM = ("tpu",)


#: Platforms where a 2-d convolution's per-example kernel gradients (the
#: ``"materialize"`` method, every mode) may run as the Pallas kernel of
#: :mod:`gram_haiku._src.compute.pallas_conv` (the padded input read into
#: VMEM once, a product per kernel tap, no im2col patches in HBM) rather
#: than as XLA's patch products (``conv.probe_cotangent_and_grads``), for
#: the layers of :func:`pallas_conv_grads_platforms`. Elsewhere Pallas
#: runs only in interpret mode (the tests put ``"cpu"`` here).
#:
#: Empty: no platform takes it by default. Per layer it was faster (below),
#: but in the whole WRN-16-4 step it was slower. One TPU v5e chip,
#: 2026-12-07, jax 0.10.2, ``python -m benchmarks --suite real --scale full
#: --model wrn --timer device`` with and without ``--no_pallas``: the
#: all-layer ``clipped_grad`` took 28.3 / 66.1 ms (B = 128 / 256) with the
#: kernel on its three 64-channel layers against 23.7 / 56.7 ms on the patch
#: path, and ``value_grad_and_gram`` (B = 256) 78.7 against 67.9 ms
#: (``benchmarks/results/real_tpu_wrn_pallas.json``). XLA's profile of the
#: step: its three calls took 1.25 ms each against 2.83 ms for the patch
#: path's loops, but with it in the program the strided 64 -> 128 layer's
#: nine stride-2 tap slices (:func:`gram_haiku._src.ops.conv.im2col`) ran
#: unfused, channels minor, 9.3 ms in all (about 1 ms fused with the
#: padding, batch minor, without it). Put ``"tpu"`` here to take it in the
#: scope below.
PALLAS_CONV_GRADS: tuple[str, ...] = ()

#: The layers the kernel was measured faster on, alone. One TPU v5e chip,
#: 2026-12-07, jax 0.10.2, ``python -m benchmarks.conv_kernels --model
#: wrn --batch_size 256`` (device time, float32, ``HIGHEST``; the kernel's
#: ``"window_t"`` form, :data:`pallas_conv.DEFAULT_FORM`), against XLA's
#: patches (whole batch / blocked, what the library runs):
#:
#: * 3x3, 64 -> 64 channels, 32x32, stride 1: **3.05 ms** against 4.44 /
#:   4.11 ms (1.35x faster than the blocked patches);
#: * 3x3, 16 -> 64, 32x32: 2.27 ms against 1.59 / 1.86 ms (slower);
#: * 3x3, 3 -> 16, 32x32: 2.15 ms against 0.16 / 0.46 ms (far slower: the
#:   three channels fill 3 of 128 lanes).
#:
#: So it is taken from :data:`PALLAS_CONV_MIN_CHANNELS` input channels and
#: :data:`PALLAS_CONV_MIN_POSITIONS` output positions per example (a
#: program of one example), at unit stride: the configuration compiled and
#: checked on the chip. Strided layers and smaller maps (several examples
#: a program) ran only in interpret mode (the device was withdrawn before
#: they were measured), so they keep the patch path.
PALLAS_CONV_MIN_CHANNELS = 64
PALLAS_CONV_MIN_POSITIONS = 512
PALLAS_CONV_STRIDED = False


def pallas_conv_grads_platforms(channels: int, positions: int,
                                unit_stride: bool) -> tuple[str, ...]:
  """The platforms of :data:`PALLAS_CONV_GRADS` on which a convolution of
  ``channels`` input channels (per feature group) and ``positions`` output
  positions per example, at unit stride or not, runs the Pallas kernel
  (the measured scope above); ``()``: the patch path. The layout checks
  (2-d, one group, VMEM) are the rule's (``conv._pallas_platforms``)."""
  if (not PALLAS_CONV_GRADS or channels < PALLAS_CONV_MIN_CHANNELS or
      positions < PALLAS_CONV_MIN_POSITIONS or
      not (unit_stride or PALLAS_CONV_STRIDED)):
    return ()
  return tuple(PALLAS_CONV_GRADS)


def pallas_ghost_gram_platforms(x, d, spread: bool) -> tuple[str, ...]:
  """The platforms of :data:`PALLAS_GHOST_GRAM` on which the ghost Gram of
  ``x: (B, T, N)``, ``d: (B, T, M)`` can run as the Pallas kernel: the
  examples on one device (not ``spread`` over a mesh: under ``shard_map``
  or an Explicit mesh XLA's path lays the blocks out over the devices),
  every size known (not a ``jax.export`` symbolic one), float32 or
  bfloat16 factors. ``()``: XLA's path."""
  if spread or not PALLAS_GHOST_GRAM:
    return ()
  if not all(isinstance(n, int) for n in (*x.shape, *d.shape)):
    return ()
  ok = ("float32", "bfloat16")
  if str(x.dtype) not in ok or str(d.dtype) not in ok:
    return ()
  return tuple(PALLAS_GHOST_GRAM)


#: Per platform, the sequence length from which the ghost norms of a
#: linear map, asked for below ``HIGHEST``, are formed at ``HIGHEST`` at
#: once. Below ``HIGHEST`` a TPU's bfloat16 passes count ``2^-7`` of each
#: product against the unsigned sum over ``T^2`` pairs of positions, so
#: over a long sequence every example's ghost bound was loose and every
#: step formed the norms twice (at the default precision, then at
#: ``HIGHEST``: ``kernels._ghost_or_fallback``). Measured on one TPU v5e
#: chip, the clipping step at ``gram_precision="default"`` (2026-12-07,
#: device time, ``benchmarks/results/tpu_default_precision/
#: highest_first_ab.json``): GPT-style decoder (``T = 256``, B = 16)
#: 39.6 ms default first, 30.7 ms at ``HIGHEST`` at once; ViT-S/4
#: (``T = 65``, B = 128) 16.2 ms default first, 18.4 ms at ``HIGHEST`` at
#: once (its layers' bounds were tight at the default precision). Not
#: measured on a GPU, so no entry: default first there.
HIGHEST_FIRST_POSITIONS = {"tpu": 128}


def highest_first_platforms(t) -> tuple[str, ...]:
  """The platforms of :data:`HIGHEST_FIRST_POSITIONS` on which the ghost
  norms over ``t`` positions are formed at ``HIGHEST`` at once (``()`` for
  a symbolic ``t``: default first everywhere)."""
  if not isinstance(t, int):
    return ()
  return tuple(p for p, least in HIGHEST_FIRST_POSITIONS.items()
               if t >= least)


def size_hint(n) -> int:
  """``n``, or :data:`SYMBOLIC_SIZE` for a symbolic size (``jax.export``),
  which cannot be compared with a number."""
  return n if isinstance(n, int) else SYMBOLIC_SIZE


#: The operations a symbolic size's text may hold (``str`` of a JAX
#: symbolic dimension expression), for :func:`value_hint`.
_SYMBOLIC_OPS = {"floordiv": lambda a, b: a // b, "mod": lambda a, b: a % b,
                 "max": max, "min": min,
                 "non_negative": lambda a: max(a, 0)}


def value_hint(n) -> int:
  """``n``, or for a symbolic expression (a size or a byte count computed
  from symbolic sizes: ``B T n * 4`` with ``T`` unknown under
  ``jax.export``) its value with every symbol taken as
  :data:`SYMBOLIC_SIZE`, as :func:`size_hint` takes a lone symbol.

  The expression is read from its text (JAX prints it with ``+``, ``*``,
  ``floordiv``, ``mod``, ``max``, ``min``); one that cannot be read counts
  as :data:`SYMBOLIC_SIZE`, never as an error.
  """
  if isinstance(n, int):
    return n
  try:
    names = {v: SYMBOLIC_SIZE for v in n.get_vars()}
    value = eval(str(n), {"__builtins__": {}},  # pylint: disable=eval-used
                 {**_SYMBOLIC_OPS, **names})
    return max(int(value), 0)
  except Exception:  # pylint: disable=broad-except
    return SYMBOLIC_SIZE


def ghost_flops(b: int, t: int, n: int, m: int, cols: int = 0) -> int:
  """Multiply-adds of the ghost method for one linear-layer weight.

  ``b`` rows (local examples) against ``cols`` columns (default ``b``).
  """
  cols = cols or b
  if t == 1:
    return b * cols * (n + m) + b * cols
  return b * cols * t * t * (n + m + 1)


def materialize_flops(b: int, t: int, n: int, m: int, cols: int = 0) -> int:
  """Extra multiply-adds of the materialised method for one linear weight.

  Forming the per-example gradients costs ``B T N M``, but their sum is the
  weight gradient, which the op then does not compute again (it would cost
  the same ``B T N M``); what is extra is ``B N M`` for the sum and
  ``B^2 N M`` for ``F F^T`` (``b cols N M`` for a block of rows).
  """
  del t
  cols = cols or b
  return b * n * m + b * cols * n * m


def gathered_bytes(cols: int, t: int, n: int, m: int, acc_bytes: int,
                   method: str) -> int:
  """Bytes one device receives to form its rows, ``cols`` examples in all.

  The ghost method gathers inputs and cotangents, ``T (N + M)`` numbers per
  example; the materialised one the per-example gradients, ``N M``.
  """
  per_example = t * (n + m) if method == "ghost" else n * m
  return cols * per_example * acc_bytes


def linear_method(b: int, t: int, n: int, m: int, acc_bytes: int, *,
                  mode: str = "gram", strategy: str = "auto", cols: int = 0,
                  budget: int = DEFAULT_MEMORY_BUDGET_BYTES) -> LinearMethod:
  """``"ghost"`` or ``"materialize"`` for a ``(B, T, N) -> M`` linear map.

  Args:
    b: local examples (rows of the Gram).
    t: within-example positions.
    n, m: input and output features.
    acc_bytes: bytes per number in the accumulation dtype.
    mode: ``"gram"``, ``"norms"`` or ``"per_example"`` (always materialised).
    strategy: ``"auto"``, or a forced ``"ghost"``/``"materialize"``.
    cols: columns of the Gram (``B``; more than ``b`` under ``shard_map``);
      default ``b``.
    budget: the memory budget in bytes.

  ``"auto"``, full Gram: the fewer multiply-adds (plus gathered bytes under
  ``shard_map``); the materialised per-example gradients are formed by
  chunks of output features where the ``cols x N x M`` of them exceed
  ``budget`` (materialised only where one feature's ``cols x N`` fit). ``"auto"``, diagonal: ghost costs ``B T^2 (N +
  M)``; materialised ``B T N M`` to form the per-example gradients, but their
  sum is the weight gradient, which the op then does not compute again, so
  what is extra is ``B N M``.
  """
  if mode == "per_example":
    return "materialize"
  if strategy != "auto":
    return strategy  # type: ignore[return-value]
  cols = cols or b
  if mode == "norms":
    fits = b * n * m * acc_bytes <= budget
    return "materialize" if fits and n * m < t * t * (n + m) else "ghost"
  # The full Gram's per-example gradients are formed by chunks of output
  # features where all of them do not fit (kernels.materialized_gram):
  # materialising only needs one feature's worth, at the same cost.
  fits = cols * n * acc_bytes <= budget
  ghost = ghost_flops(b, t, n, m, cols)
  mat = materialize_flops(b, t, n, m, cols)
  if cols > b:
    ghost += COMM_FLOPS_PER_BYTE * gathered_bytes(cols, t, n, m, acc_bytes,
                                                  "ghost")
    mat += COMM_FLOPS_PER_BYTE * gathered_bytes(cols, t, n, m, acc_bytes,
                                                "materialize")
  return "materialize" if fits and mat < ghost else "ghost"


def conv_method(b: int, t: int, n: int, m: int, groups: int, acc_bytes: int,
                *, mode: str = "gram", strategy: str = "auto", cols: int = 0,
                budget: int = DEFAULT_MEMORY_BUDGET_BYTES) -> ConvMethod:
  """The method for a convolution: ``F`` groups of ``(B, T, n) -> m`` maps.

  ``n = C/F * |K|`` patch features and ``m = O/F`` outputs per group, ``t``
  within-example times output positions. Per group it is
  :func:`linear_method`, except for the diagonal under ``"auto"``: unlike a
  linear layer's, a convolution's per-example gradients need the im2col
  patches, where its plain kernel gradient needs none, so they are formed
  only where that beats the ghost norms' ``B T^2 (n + m)`` outright
  (measured on the benchmarks' CNN). Materialised groups are formed all at
  once when ``cols x F x n x m`` numbers fit the budget, else one at a time.
  """
  if mode == "per_example":
    return "materialize"
  cols = cols or b
  if mode == "norms" and strategy == "auto":
    fits = b * n * m * acc_bytes <= budget
    per_group = ("materialize" if fits and t * n * m < t * t * (n + m)
                 else "ghost")
  else:
    per_group = linear_method(b, t, n, m, acc_bytes, mode="gram",
                              strategy=strategy, cols=cols, budget=budget)
  if per_group == "ghost":
    return "ghost"
  if cols * groups * n * m * acc_bytes <= budget:
    return "materialize"
  return "materialize_by_group"


#: Patches smaller than this are formed for every example at once (see
#: :func:`patch_block`): there a loop over blocks costs more time than the
#: memory it saves (the benchmarks' small CNN, 73 KB of patches in blocks
#: of 2 examples: full Gram 1.66x -> 1.86x a plain step).
PATCH_BLOCK_MIN_BYTES = 4 * 2**20


def patch_block(b: int, patch_bytes: int, live_bytes: int) -> int:
  """Examples per block when a convolution forms its per-example gradients.

  The im2col patches of all ``b`` examples take ``patch_bytes`` (``B T n``
  numbers, ``|K| / stride`` times the input). Formed a block of examples
  at a time (each block's patches contracted with its cotangents, then
  freed), at most ``live_bytes`` of them exist at once: the size of the
  layer's input, which is held at that point anyway. The blocks are a
  loop, so the convolution takes them on the CPU only (elsewhere only when
  the whole batch's patches exceed the memory budget; see
  ``conv.probe_cotangent_and_grads``). Same multiply-adds; on
  the benchmarks' CNN the compiled temp memory went from 1.46x to 1.26x a
  plain step for the full Gram, and from 1.44x to 1.23x for the all-layer
  clipped gradient (3x3 kernels: patches 9 and 2.25 times the input of
  the first two convolutions). Returns ``b`` (one block)
  when the patches fit. A block size that divides ``b`` is preferred (a
  remainder block costs a copy of the per-example gradients), down to half
  the largest that fits. Patches under :data:`PATCH_BLOCK_MIN_BYTES` are
  not blocked. The byte counts may be symbolic (:func:`value_hint`).
  """
  # Under jax.export a symbolic sequence length makes both byte counts
  # symbolic: estimated at SYMBOLIC_SIZE, as every other choice from sizes.
  patch_bytes, live_bytes = value_hint(patch_bytes), value_hint(live_bytes)
  if patch_bytes <= max(live_bytes, PATCH_BLOCK_MIN_BYTES) or b <= 1:
    return b
  largest = max(1, int(live_bytes * b // patch_bytes))
  divisor = max(k for k in range(1, largest + 1) if b % k == 0)
  return divisor if 2 * divisor >= largest else largest


def embed_costs(b: int, t: int, dim: int, num_keys: int, acc_bytes: int,
                cols: int = 0, budget: int = DEFAULT_MEMORY_BUDGET_BYTES
                ) -> dict[str, float]:
  """Weighted operation counts of each form of an embedding's Gram.

  ``b`` rows against ``cols`` columns (``B`` gathered under ``shard_map``;
  default ``b``), ``t`` lookups per example, width ``dim``, ``num_keys``
  distinct rows. ``"dense"`` is absent when its ``cols x num_keys x dim``
  per-example gradients exceed ``budget``. Gathering the columns' factors
  adds :data:`COMM_FLOPS_PER_BYTE` per byte: ``T (D + 1)`` numbers per
  example for the ghost and segment forms (ids and rows), ``V D`` for dense.
  """
  cols = cols or b
  log_t = math.log2(max(t, 2))
  costs = {
      "ghost": b * cols * t * t * (dim + 2),
      "segment": GATHER_WEIGHT * (b * t * (dim + 2 * log_t + 2) +
                                  b * cols * t * (dim + log_t + 2)),
  }
  if cols * num_keys * dim * acc_bytes <= budget:
    costs["dense"] = GATHER_WEIGHT * b * t * dim + b * cols * num_keys * dim
  if cols > b:
    comm = COMM_FLOPS_PER_BYTE * cols * acc_bytes
    costs["ghost"] += comm * t * (dim + 1)
    costs["segment"] += comm * t * (dim + 1)
    if "dense" in costs:
      costs["dense"] += comm * num_keys * dim
  return costs


def embed_method(b: int, t: int, dim: int, num_keys: int, acc_bytes: int, *,
                 mode: str = "gram", strategy: str = "auto", cols: int = 0,
                 budget: int = DEFAULT_MEMORY_BUDGET_BYTES) -> EmbedMethod:
  """``"ghost"``, ``"dense"`` or ``"segment"`` for an embedding lookup.

  Full Gram: ``"ghost"`` forces the ghost form; ``"materialize"`` the dense
  per-example gradients when they fit ``budget``, else the segment form;
  ``"auto"`` the cheapest by :func:`embed_costs` (ties go to ghost).
  Diagonal: ghost (``~B T^2 D``) or segment (``~B T (D + log T)``; dense is
  never needed for it). ``"per_example"`` mode does not consult this.
  """
  if mode == "norms":
    if strategy == "ghost":
      return "ghost"
    if strategy == "materialize":
      return "segment"
    log_t = math.log2(max(t, 2))
    ghost = b * t * t * (dim + 2)
    segment = GATHER_WEIGHT * b * t * (dim + 2 * log_t + 2)
    return "ghost" if ghost <= segment else "segment"
  costs = embed_costs(b, t, dim, num_keys, acc_bytes, cols, budget)
  if strategy == "ghost":
    return "ghost"
  if strategy == "materialize":
    return "dense" if "dense" in costs else "segment"
  return min(("ghost", "dense", "segment"),
             key=lambda k: costs.get(k, math.inf))  # type: ignore[return-value]


#: What a layer keeps through the backward pass of a reweighted gradient:
#: its book-keeping factors (input and output cotangent per example), or
#: its per-example gradients (see :func:`bookkeeping_method`).
BookkeepingMethod = Literal["factors", "per_example"]


def bookkeeping_method(num_params: int, factor_width: int,
                       factors_exact: bool) -> BookkeepingMethod:
  """How a layer keeps what :func:`gram_haiku.reweighted_grad` needs.

  Both are exact and take one backward pass (Bu, Mao, Xu, Karypis 2023,
  "Differentially private optimization on large model at small cost", the
  book-keeping trick). Per example the factors hold ``K`` entries (the
  input and the output cotangent: ``T (N + M)`` for a linear layer applied
  at ``T`` positions) and the per-example gradients ``P`` (``N M + M``);
  the smaller store wins, ties to the factors. (Counting multiply-adds
  favours the per-example gradients over many positions, since they give
  the norms and save a weight-gradient contraction; measured, they were
  slower on the benchmark LM and CNN: 1.55x and 1.34x a plain step against
  1.36x and 1.13x for this rule.) Factors are only kept where the input
  survives the probe's float dtype (``factors_exact``).
  """
  if factors_exact and factor_width < num_params:
    return "factors"
  return "per_example"


def per_example_operand_bytes(b: int, operand_size: int,
                              acc_bytes: int) -> int:
  """The memory of a program-level site evaluated once per example
  (:data:`gram_haiku._src.analysis.program_rules.PER_EXAMPLE_RULES`: a
  bare weight in a contraction that is not ``hk.Linear``'s, a kernel in
  ``lax.conv``, a table read by ``table[ids]``): the operand stacked per
  example (``Z``), its cotangent and the per-example gradients, each ``B x
  |operand|``. No other method exists for these sites yet (a tracked
  layer, ``hk.Conv*``, ``hk.Embed``, takes the ghost methods above
  instead; a bare weight in ``x @ W`` takes :func:`linear_method`'s, as
  ``hk.Linear`` does: :data:`gram_haiku._src.analysis.program_rules.
  LINEAR_FORMS`), so this is a cost to know, not a choice: a bare table
  of ``V x D`` entries costs ``3 B V D`` entries.
  """
  return 3 * b * operand_size * acc_bytes


def linear_norms_from_factors(b: int, t: int, n: int, m: int, acc_bytes: int,
                              budget: int = DEFAULT_MEMORY_BUDGET_BYTES
                              ) -> LinearMethod:
  """The norms of a linear layer from its kept factors, after the pass.

  Unlike :func:`linear_method`'s diagonal, nothing reuses the materialised
  per-example gradients here (the weight gradient is re-contracted anyway),
  so materialising costs ``B T N M`` against the ghost ``B T^2 (N + M)``.
  """
  fits = b * n * m * acc_bytes <= budget
  return "materialize" if fits and n * m < t * (n + m) else "ghost"
