"""Canaries: every private or version-moving JAX and Haiku name we use exists.

``hijax_compat`` and ``haiku_compat`` are the only modules that import such
names; these tests fail first, and by name, when a release moves one (tox
runs them against the oldest and the newest supported JAX).
"""

import ast
import pathlib

import haiku as hk
import jax
import jax.numpy as jnp
import pytest

import gram_haiku
from gram_haiku._src.compat import haiku_compat as hkc
from gram_haiku._src.compat import hijax_compat as hx

SRC = pathlib.Path(gram_haiku.__file__).parent


@pytest.mark.parametrize("module", [hx, hkc], ids=["hijax", "haiku"])
def test_every_exported_name_exists(module):
  for name in module.__all__:
    assert hasattr(module, name), f"{module.__name__}.{name} is missing"


def test_hijax_names():
  for name in ("VJPHiPrimitive", "Zero", "instantiate_zeros", "Literal"):
    assert getattr(hx, name) is not None, name
  assert callable(hx._hijax.fake_linear_op)  # pylint: disable=protected-access
  for name in ("GradAccum", "NullAccum", "RefAccum"):
    assert hasattr(hx._ad, name), name  # pylint: disable=protected-access


def test_setup_cfg_pins_the_range_checked_at_import():
  cfg = (SRC.parent / "setup.cfg").read_text()
  low = ".".join(map(str, hx.MIN_JAX_VERSION))
  high = ".".join(map(str, hx.MAX_JAX_VERSION_EXCLUSIVE[:2]))
  for package in ("jax", "jaxlib"):
    assert f"    {package}>={low},<{high}\n" in cfg, package
  assert hx.MIN_JAX_VERSION <= hx.JAX_VERSION < hx.MAX_JAX_VERSION_EXCLUSIVE


def test_scan_operand_counts_are_read():
  def loop(c, xs, k, h):
    def body(carry, x):
      a, b = carry
      return (a + x * k, b * h), a
    return jax.lax.scan(body, (c, c), xs)
  jaxpr = jax.make_jaxpr(loop)(1.0, jnp.arange(4.0), 2.0, 3.0)
  (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
  n_consts, n_carry = hx.scan_counts(eqn)
  assert (n_consts, n_carry) == (2, 2)
  assert len(eqn.invars) == n_consts + n_carry + 1


def test_a_bound_op_is_found_in_its_equation():
  # Every analysis finds the Gram ops in the traced program through
  # hijax_compat.gram_op_of; the equation's parameter holding the op moves
  # between jax releases ('prim' in 0.9, '_prim' from 0.10).
  from gram_haiku._src.ops import op as op_lib  # pylint: disable=g-import-not-at-top
  x, w, b = jnp.ones((4, 3)), jnp.ones((3, 2)), jnp.ones((2,))
  jaxpr = jax.make_jaxpr(lambda x, w, b, p: gram_haiku.ops.gram_linear(
      x, w, b, p))(x, w, b, jnp.zeros((4, 4)))
  ops = [hx.gram_op_of(e, op_lib.RuleOp) for e in jaxpr.jaxpr.eqns]
  ops = [op for op in ops if op is not None]
  assert len(ops) == 1 and ops[0].name == "linear", jaxpr


def test_custom_jvp_rules_are_read():
  # The example flow reads custom_jvp rules through the equation's
  # parameters (hijax_compat.custom_jvp_rule); None would make every
  # jax.nn.relu an unfollowed primitive (a warning per model).
  jaxpr = jax.make_jaxpr(jax.nn.relu)(jnp.ones((2, 3)))
  eqns = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "custom_jvp_call"]
  for e in jaxpr.jaxpr.eqns:
    for sub in hx.jaxprs_of(e):
      eqns += [q for q in sub.eqns if q.primitive.name == "custom_jvp_call"]
  assert eqns
  rule = hx.custom_jvp_rule(eqns[0])
  assert rule is not None
  rule_jaxpr, _, out_zeros = rule
  assert len(rule_jaxpr.outvars) == 1 + out_zeros.count(False)


def test_haiku_private_attributes_exist():
  """The module attributes the handlers read are still there."""
  seen = {}

  def f(x):
    ln = hk.LayerNorm(-1, True, True)
    ln(x)
    seen["param_axis"] = hkc.param_axis_passed_explicitly(ln)
    gn = hk.GroupNorm(2)
    hkc.initialize_group_norm(gn, x[:, None, :], x.shape[-1])
    seen["group_shape"] = gn.group_shape
    seen["inside"] = hkc.inside_transform()
    seen["frame"] = hkc.current_frame() is not None
    outer = hkc.outermost_frame()
    seen["lifted"] = hk.remat(lambda a: (
        hkc.outermost_frame() is outer and hkc.current_frame() is not outer,
        a))(x)[0]
    w = hk.get_parameter("w", (3,), init=jnp.ones)
    seen["stored"] = [p is w for p in hkc.stored_parameters("~")]
    s = hk.get_state("s", (2,), init=jnp.ones)
    seen["state"] = (hkc.stored_state("s") is s, hkc.stored_state("t"))
    return x
  hk.transform_with_state(f).init(jax.random.PRNGKey(0), jnp.ones((2, 4)))
  assert seen["lifted"] and seen["stored"] == [True]
  assert seen["state"] == (True, None)
  assert seen["param_axis"] is False
  assert seen["inside"] and seen["frame"]
  assert tuple(seen["group_shape"])[-2:] == (2, 2)
  assert not hkc.inside_transform()
  assert isinstance(hkc.error_if_param_axis_not_explicit(), bool)
  assert tuple(hkc.calculate_bias_shape((2, 3, 4), [-1])) == (4,)
  assert hkc.to_abs_axes([-1], 3) == (2,)
  hkc.assert_minimum_rank(jnp.ones((2, 3)), 2)
  pad = hkc.compute_adjusted_padding(4, 8, 3, 2, "SAME")
  assert len(pad) == 2


def _imports(path):
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      yield node.module
    elif isinstance(node, ast.Import):
      for alias in node.names:
        yield alias.name


def test_private_names_only_in_compat_modules():
  """``jax._src`` and ``haiku._src`` are imported in the compat modules only."""
  offenders = []
  for path in sorted(SRC.rglob("*.py")):
    if path.name in ("hijax_compat.py", "haiku_compat.py"):
      continue
    for module in _imports(path):
      if module.startswith(("jax._src", "haiku._src", "jax.experimental.hijax")):
        offenders.append(f"{path.relative_to(SRC)}: {module}")
  assert not offenders, offenders


def test_no_thread_local_state_outside_ambient():
  """Only ``ambient`` keeps thread-local state (no op, rule or kernel does)."""
  offenders = [str(p.relative_to(SRC)) for p in sorted(SRC.rglob("*.py"))
               if "threading" in set(_imports(p)) and p.name != "ambient.py"]
  assert not offenders, offenders


# The folders of ``gram_haiku/_src``, bottom layer first (the map is
# gram_haiku/_src/README.md). A module imports from its own folder or the
# folders before it, never after: the kernels do not know Haiku, the Haiku
# front end does not know the passes, the passes do not know the API.
_LAYER_ORDER = ("compat", "core", "compute", "rules", "ops", "frontend",
                "layers", "analysis", "passes", "api")


def _folder(module):
  """The ``_src`` folder of a ``gram_haiku._src...`` module name, or None."""
  parts = module.split(".")
  return parts[2] if parts[:2] == ["gram_haiku", "_src"] and len(parts) > 2 else None


def test_src_folders_are_the_layers_in_the_readme():
  folders = sorted(p.name for p in (SRC / "_src").iterdir()
                   if p.is_dir() and p.name != "__pycache__")
  assert folders == sorted(_LAYER_ORDER)
  readme = (SRC / "_src" / "README.md").read_text()
  positions = [readme.index(f"{name}/") for name in _LAYER_ORDER]
  # The README draws the layers top (API) to bottom (compat).
  assert positions == sorted(positions, reverse=True), positions
  # No module is left at the top of _src but the package's own __init__.
  assert sorted(p.name for p in (SRC / "_src").glob("*.py")) == ["__init__.py"]


def test_imports_point_down_the_layers():
  """Every ``_src`` module imports only from its own folder or a lower one;
  ``gram_haiku``'s public modules and the apps only from the public API
  (``gram_haiku``, ``gram_haiku.ops``, ``gram_haiku.testing``) or, for the
  public modules, ``_src``; the conformance suite's framework imports no
  ``_src`` (its built-in op specs under ``conformance/ops/`` bind the
  library's own rules, and may)."""
  rank = {name: i for i, name in enumerate(_LAYER_ORDER)}
  offenders = []
  for path in sorted((SRC / "_src").rglob("*.py")):
    rel = path.relative_to(SRC / "_src")
    if len(rel.parts) == 1:  # _src/__init__.py registers the layers.
      continue
    own = rank[rel.parts[0]]
    for module in _imports(path):
      if module == "gram_haiku" or module.startswith((
          "gram_haiku.conformance", "gram_haiku.apps", "gram_haiku.testing",
          "gram_haiku.ops")):
        offenders.append(f"_src/{rel}: {module} (a public module)")
      folder = _folder(module)
      if folder is not None and rank[folder] > own:
        offenders.append(f"_src/{rel}: {module} (layer {folder!r} is above "
                         f"{rel.parts[0]!r})")
  outside = list((SRC / "apps").rglob("*.py")) + [
      p for p in (SRC / "conformance").rglob("*.py")
      if "ops" not in p.relative_to(SRC / "conformance").parts[:-1]]
  for path in sorted(outside):
    for module in _imports(path):
      if module.startswith("gram_haiku._src"):
        offenders.append(f"{path.relative_to(SRC)}: {module}")
  assert not offenders, "\n".join(offenders)


# Cross-module uses of another _src module's underscore names, each with the
# reason it stays: (file under _src, module, name).
_PRIVATE_USES_ALLOWED = {
    # BatchNorm's handler builds its affine part with LayerNorm's helper
    # (both in layers/); issue 46 item 4 (built-in layers as plain rules)
    # rewrites both modules, and the helper with them.
    ("layers/batch_norm.py", "gram_haiku._src.layers.norms", "_affine"),
}


def _private_uses(path):
  """``(module, name)`` of each underscore name of another ``gram_haiku._src``
  module that ``path`` imports or reads as ``module._name``."""
  tree = ast.parse(path.read_text())
  modules = {}  # local name -> the gram_haiku._src module it is
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
        "gram_haiku._src"):
      for alias in node.names:
        if alias.name.startswith("_") and not alias.name.startswith("__"):
          yield node.module, alias.name
        modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith("gram_haiku._src"):
          modules[alias.asname or alias.name] = alias.name
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and
        isinstance(node.value, ast.Name) and node.value.id in modules and
        node.attr.startswith("_") and not node.attr.startswith("__")):
      yield modules[node.value.id], node.attr


def test_no_module_uses_another_modules_private_names():
  """Inside ``_src`` a module reads only the public names of another (the
  pass pipeline's steps are public functions of
  :mod:`gram_haiku._src.passes.pass_pipeline`, not one driver's helpers called by
  another)."""
  found = set()
  for path in sorted((SRC / "_src").rglob("*.py")):
    rel = str(path.relative_to(SRC / "_src"))
    for module, name in _private_uses(path):
      found.add((rel, module, name))
  assert not found - _PRIVATE_USES_ALLOWED, sorted(
      found - _PRIVATE_USES_ALLOWED)
  # An entry no longer needed is removed, so the list stays short and true.
  assert not _PRIVATE_USES_ALLOWED - found, sorted(
      _PRIVATE_USES_ALLOWED - found)


def test_raw_jax_transform_is_told_from_haiku_lifted_ones():
  """Haiku's trace levels: inside ``hk.scan``/``hk.vmap`` Haiku state may be
  set (a slot counter); inside a raw ``jax.lax.scan``/``jax.vmap`` it may
  not (``value_grad_and_gram`` then keeps no slots)."""
  seen = {}

  def f(x):
    seen["top"] = hkc.inside_raw_jax_transform()
    def step(c, xt):
      seen.setdefault("hk_scan", hkc.inside_raw_jax_transform())
      return c, xt
    hk.scan(step, 0.0, x)
    def row(key):
      def record(r):
        seen.setdefault(key, hkc.inside_raw_jax_transform())
        return r
      return record
    hk.vmap(row("hk_vmap"), split_rng=False)(x)
    def raw(c, xt):
      seen.setdefault("lax_scan", hkc.inside_raw_jax_transform())
      return c, xt
    jax.lax.scan(raw, 0.0, x)
    jax.vmap(row("jax_vmap"))(x)
    return x
  hk.transform(f).apply({}, None, jnp.ones((3, 2)))
  assert seen == {"top": False, "hk_scan": False, "hk_vmap": False,
                  "lax_scan": True, "jax_vmap": True}, seen
