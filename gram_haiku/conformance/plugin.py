"""pytest plugin for the conformance suite (pytest11 entry point
``gram_haiku_conformance``).

It loads in every pytest run of an environment that has gram_haiku
installed, so it imports nothing heavy (no JAX, NumPy or hypothesis) until
a run selects ops or collects a conformance test.

Options (each also an environment variable, for tox and CI):

* ``--conformance-ops`` / ``CONFORMANCE_OPS``: comma-separated op names to
  check (default: every registered op). A name no module registered ends
  the run with one message: the registered ops, and how to register one.
* ``--conformance-thorough`` / ``CONFORMANCE_THOROUGH=1``: every (op, case)
  pair, every layout and a larger hypothesis budget (nightly runs); by
  default each case runs on at least :data:`OPS_PER_CASE` of the built-in
  ops (see :func:`sample_items`), and every case of a third party's op
  runs.
* ``--conformance-modules`` / ``CONFORMANCE_MODULES``: comma-separated
  modules to import first (they register your ops; the sharded runner
  imports them too). Not needed for a ``conftest.py`` that registers them.
* ``--conformance-timeout`` / ``CONFORMANCE_TIMEOUT_S``: seconds a
  multi-device runner subprocess may take (default 3600; 0 for none).
* ``CONFORMANCE_PIN_DEVICES=1``: under pytest-xdist, each worker sees one
  accelerator (``CUDA_VISIBLE_DEVICES`` / ``TPU_VISIBLE_CHIPS`` set from
  ``PYTEST_XDIST_WORKER`` before JAX starts) and does not preallocate.

The tests are made from the check registry
(:mod:`gram_haiku.conformance.families`), one per check, so a family
registered there (built in, or a third party's) is collected, sampled and
tabled like the others.

Fixtures: ``conformance_op`` (parametrised over the selected ops),
``conformance_group`` (over the property searches' groups of ops, see
:func:`op_groups`) and ``conformance_platform`` (over the platforms of
cpu/gpu/tpu that are present; the absent ones are named once in the
terminal summary).
"""

import collections
import os

import pytest

PLATFORMS = ("cpu", "gpu", "tpu")


def pin_worker_device(environ=os.environ) -> dict:
  """Pins this xdist worker to one accelerator, if opted in.

  Reads ``PYTEST_XDIST_WORKER`` (``gw0``, ``gw1``...) and sets
  ``CUDA_VISIBLE_DEVICES`` and ``TPU_VISIBLE_CHIPS`` to the worker's index
  (modulo ``CONFORMANCE_NUM_DEVICES`` when given) and
  ``XLA_PYTHON_CLIENT_PREALLOCATE=false``, so that workers share a machine
  without fighting over device memory. Must run before JAX initialises a
  backend. Returns the variables it set.
  """
  if environ.get("CONFORMANCE_PIN_DEVICES", "") not in ("1", "true", "yes"):
    return {}
  worker = environ.get("PYTEST_XDIST_WORKER", "")
  if not worker.startswith("gw"):
    return {}
  index = int(worker[2:])
  count = int(environ.get("CONFORMANCE_NUM_DEVICES", "0") or 0)
  if count > 0:
    index %= count
  pinned = {"CUDA_VISIBLE_DEVICES": str(index),
            "TPU_VISIBLE_CHIPS": str(index),
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  environ.update(pinned)
  return pinned


def thorough() -> bool:
  """Whether the nightly budget is on (``--conformance-thorough`` sets the
  environment variable in :func:`pytest_configure`, for xdist workers too)."""
  return os.environ.get("CONFORMANCE_THOROUGH", "") in ("1", "true")


def pytest_addoption(parser):
  group = parser.getgroup("conformance")
  group.addoption("--conformance-ops", default=os.environ.get(
      "CONFORMANCE_OPS", ""), help="comma-separated op names to check "
      "(default: all registered; env CONFORMANCE_OPS)")
  group.addoption(
      "--conformance-thorough", action="store_true",
      default=thorough(),
      help="raise the hypothesis example budget (env CONFORMANCE_THOROUGH=1)")
  group.addoption(
      "--conformance-modules", default=os.environ.get(
          "CONFORMANCE_MODULES", ""), help="comma-separated modules to "
      "import: they register your ops (env CONFORMANCE_MODULES)")
  group.addoption(
      "--conformance-timeout", default=None, metavar="SECONDS",
      help="seconds a multi-device runner subprocess may take (default "
      "3600, 0 for none; env CONFORMANCE_TIMEOUT_S)")


def pytest_configure(config):
  pin_worker_device()
  import importlib  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  if extra_modules(config):  # Importable from where pytest runs.
    for path in (str(config.rootpath), str(config.invocation_params.dir)):
      if path not in sys.path:
        sys.path.insert(0, path)
  for module in extra_modules(config):
    importlib.import_module(module)
  if config.getoption("--conformance-thorough", default=False):
    # Read at collection time by the families (and by xdist workers, which
    # inherit the environment).
    os.environ["CONFORMANCE_THOROUGH"] = "1"
  timeout = config.getoption("--conformance-timeout", default=None)
  if timeout is not None:  # Read by the runner module, in workers too.
    os.environ["CONFORMANCE_TIMEOUT_S"] = str(timeout)
  config.addinivalue_line(
      "markers", "conformance_family(name): the check family of a test")
  config.addinivalue_line("markers", "conformance: a conformance-suite test")
  check_selected_ops(config)


def extra_modules(config) -> list[str]:
  """The ``--conformance-modules`` names."""
  return [m for m in config.getoption("--conformance-modules").split(",")
          if m]


def selected_ops(config):
  """The registered ops that ``--conformance-ops`` names (every registered op
  when it names none); unknown names are left out here (they end the run
  at configuration, see :func:`check_selected_ops`)."""
  from gram_haiku.conformance.registry import registered_ops  # pylint: disable=g-import-not-at-top
  names = _op_names(config)
  return [op for op in registered_ops() if not names or op.name in names]


def _op_names(config) -> list[str]:
  return [n for n in config.getoption("--conformance-ops").split(",") if n]


def check_selected_ops(config) -> None:
  """Ends the run with one message (what ops exist, how to register one) when
  ``--conformance-ops`` names an op that no module registered: not one
  collection error per test module, nor an empty hypothesis search."""
  names = _op_names(config)
  if not names:
    return
  from gram_haiku.conformance import registry  # pylint: disable=g-import-not-at-top
  known = [op.name for op in registry.registered_ops()]
  unknown = set(names) - set(known)
  if unknown:
    raise pytest.UsageError(registry.unknown_ops_message(unknown, known))


class OpGroup:
  """The ops one property-based search draws its models from: each model's
  first op from ``first``, the others from ``rest``.

  A third party's op has a group of its own (with the selected built-in ops
  as the others), so that its row fails only for its own bugs; the selected
  built-in ops share one group, labelled :data:`BUILTIN_GROUP` (or by the op's
  name when only one is selected).
  """

  def __init__(self, label, first, rest):
    self.label, self.first, self.rest = label, list(first), list(rest)

  def __repr__(self):
    return f"OpGroup({self.label!r})"


#: The label of the built-in ops' property-search group in the table.
BUILTIN_GROUP = "built-in"


def op_groups(ops) -> list[OpGroup]:
  """The property-search groups of the selected ``ops`` (see
  :class:`OpGroup`)."""
  from gram_haiku.conformance import registry  # pylint: disable=g-import-not-at-top
  builtins = [op for op in ops if registry.is_builtin(op)]
  groups = []
  if builtins:
    label = builtins[0].name if len(builtins) == 1 else BUILTIN_GROUP
    groups.append(OpGroup(label, builtins,
                          [op for op in builtins if not op.integer_input]))
  for op in ops:
    if not registry.is_builtin(op):
      groups.append(OpGroup(op.name, [op], [
          o for o in [op] + builtins if not o.integer_input]))
  return groups


def pytest_generate_tests(metafunc):
  if "conformance_op" in metafunc.fixturenames:
    ops = selected_ops(metafunc.config)
    metafunc.parametrize("conformance_op", ops, ids=[op.name for op in ops])
  if "conformance_group" in metafunc.fixturenames:
    groups = op_groups(selected_ops(metafunc.config))
    metafunc.parametrize("conformance_group", groups,
                         ids=[g.label for g in groups])
  if "conformance_platform" in metafunc.fixturenames:
    metafunc.parametrize("conformance_platform", present_platforms(),
                         indirect=True)


def present_platforms() -> list[str]:
  """The platforms of :data:`PLATFORMS` that ``jax.devices()`` reports: the
  suite's cases are parametrised over these alone (the absent ones get one
  line in the terminal summary, not a skip per case)."""
  from gram_haiku.conformance.checks import platforms_present  # pylint: disable=g-import-not-at-top
  present = platforms_present()
  return [p for p in PLATFORMS if p in present]


@pytest.fixture
def conformance_platform(request):
  return request.param


def pytest_terminal_summary(terminalreporter):
  """One line naming the platforms that the cases did not run on (read from
  the reports, so that the pytest-xdist controller starts no JAX backend)."""
  absent = set()
  for reports in terminalreporter.stats.values():
    for report in reports:
      props = dict(getattr(report, "user_properties", ()) or ())
      if "conformance_absent" in props:
        absent.update(p for p in props["conformance_absent"].split(",") if p)
  if absent:
    terminalreporter.write_line(
        f"conformance: platform(s) {', '.join(sorted(absent))} not present "
        "here (jax.devices() reports none), so their cases were not "
        "collected; run on a machine that has them to check those backends.")


#: In the default budget, each case of a family (a dtype, a layout, a
#: transform) runs on about this many of the selected built-in ops, spread
#: so that every op still runs every family (a row of the table: at least
#: one case of one of the family's test functions);
#: ``--conformance-thorough`` runs every (op, case) pair. With fewer than
#: twice this many built-in ops selected, every pair runs. A third party's ops are never sampled: every
#: case of theirs runs (see :func:`gram_haiku.conformance.registry.is_builtin`).
OPS_PER_CASE = 1
#: Families never sampled (every case of every op runs). The sharded
#: family is sampled like the others: its runner computes only the kept
#: (op, layout) pairs (gram_haiku/conformance/test_sharded.py).
UNSAMPLED_FAMILIES = ()


def _case_key(item):
  params = dict(item.callspec.params)
  params.pop("conformance_op", None)
  params.pop("conformance_platform", None)
  return (item.originalname, tuple(sorted((k, repr(v))
                                          for k, v in params.items())))


def sample_items(items, op_names):
  """The items of the default budget, and the deselected rest.

  Only the ops ``op_names`` (the selected built-in ops) are sampled: an
  item of any other op is kept. Among the tests of one family (a row of
  the summary table: the ``vmap`` family's two test functions, say), op
  ``i`` (in registration order) runs its ``r``-th applicable case (a test
  function and its parameters, in collection order) when
  ``(i + r) % stride == 0``, with ``stride = min(n_ops // OPS_PER_CASE,
  n)`` and ``n`` the op's number of applicable cases of the family: every
  op runs at least one applicable case of every family, and every case
  runs on about ``n_ops / stride`` of the ops, at least one. Cases known
  not to apply (a parity dtype the op cannot take) are deselected.
  """
  stride = len(op_names) // OPS_PER_CASE
  if stride <= 1:
    return list(items), []
  op_index = {n: i for i, n in enumerate(op_names)}
  rank = {}  # (function, op) -> {case key: rank among the op's cases}
  for item in items:
    callspec = getattr(item, "callspec", None)
    family = item.get_closest_marker("conformance_family")
    if (callspec is None or family is None or "conformance_op" not in
        callspec.params or family.args[0] in UNSAMPLED_FAMILIES
        or not _applies(item)):
      continue
    per_op = rank.setdefault(
        (family.args[0], callspec.params["conformance_op"].name), {})
    per_op.setdefault(_case_key(item), len(per_op))
  keep, drop = [], []
  for item in items:
    callspec = getattr(item, "callspec", None)
    if callspec is None or "conformance_op" not in callspec.params:
      keep.append(item)
      continue
    op = callspec.params["conformance_op"].name
    family = item.get_closest_marker("conformance_family")
    per_op = (rank.get((family.args[0], op)) if family is not None
              else None)
    if op not in op_index or (family is not None and
                              family.args[0] in UNSAMPLED_FAMILIES):
      keep.append(item)
    elif not per_op or not _applies(item):
      (drop if family is not None else keep).append(item)
    else:
      r = per_op[_case_key(item)]
      n = min(stride, len(per_op))
      (keep if (op_index[op] + r) % n == 0 else drop).append(item)
  return keep, drop


def _applies(item) -> bool:
  """False for a case known not to apply to the item's op (its check's
  ``applies``, :class:`gram_haiku.conformance.families.Check`)."""
  from gram_haiku.conformance import families  # pylint: disable=g-import-not-at-top
  check = families.check_named(item.originalname)
  if check is None or check.applies is None:
    return True
  params = item.callspec.params
  case = families.Case(item.callspec.id,
                       tuple(params[n] for n in check.params))
  return not check.why_not(params["conformance_op"], case)


def _row(item):
  """The summary table's (op, family, platform) of a conformance item, or
  None for any other item."""
  callspec = getattr(item, "callspec", None)
  family = item.get_closest_marker("conformance_family")
  if callspec is None or family is None:
    return None
  op = callspec.params.get("conformance_op")
  group = callspec.params.get("conformance_group")
  if op is None and group is None:
    return None
  return (op.name if op is not None else group.label, family.args[0],
          callspec.params.get("conformance_platform", "cpu"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
  """Samples the default budget (see :func:`sample_items`); records op,
  family and platform of each test (for the summary table), how many of
  its row's cases the budget deselected, and the platforms that are
  absent. Runs after ``-k``/``-m`` have deselected theirs: a row counts
  the cases the budget left out of those selected."""
  del session
  deselected = collections.Counter()
  if not thorough() and any(getattr(item, "callspec", None) is not None and
                            "conformance_op" in item.callspec.params
                            for item in items):
    from gram_haiku.conformance import registry  # pylint: disable=g-import-not-at-top
    sampled = [op.name for op in selected_ops(config)
               if registry.is_builtin(op)]
    keep, drop = sample_items(items, sampled)
    if drop:
      config.hook.pytest_deselected(items=drop)
      items[:] = keep
      # Rows whose cases the budget left out (not those known not to apply).
      deselected.update(filter(None, (_row(i) for i in drop
                                      if _applies(i))))
  absent = None
  for item in items:
    row = _row(item)
    if row is None:
      continue
    if absent is None:
      absent = [p for p in PLATFORMS if p not in present_platforms()]
    item.user_properties.append(("conformance_op", row[0]))
    item.user_properties.append(("conformance_family", row[1]))
    item.user_properties.append(("conformance_platform", row[2]))
    item.user_properties.append(("conformance_absent", ",".join(absent)))
    item.user_properties.append(("conformance_deselected", deselected[row]))
