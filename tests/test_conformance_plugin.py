"""The plugin: xdist device pinning, the runners' environment, what it
imports, the third party's command line (their conftest.py, an unknown op)
and the default budget (never a third party's op; the table says what was
sampled); the deprecated top-level ``conformance`` alias."""

import json
import os
import subprocess
import sys

import pytest

from gram_haiku.conformance import plugin
from gram_haiku.conformance import runner
from tests.test_runner import _Item  # A pytest item as the table reads it.

pytestmark = pytest.mark.conformance


def test_pinning_is_opt_in():
  env = {"PYTEST_XDIST_WORKER": "gw3"}
  assert plugin.pin_worker_device(env) == {}
  assert "CUDA_VISIBLE_DEVICES" not in env


def test_pinning_sets_one_device_per_worker():
  env = {"PYTEST_XDIST_WORKER": "gw3", "CONFORMANCE_PIN_DEVICES": "1"}
  plugin.pin_worker_device(env)
  assert env["CUDA_VISIBLE_DEVICES"] == "3"
  assert env["TPU_VISIBLE_CHIPS"] == "3"
  assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"


def test_pinning_wraps_around_the_device_count():
  env = {"PYTEST_XDIST_WORKER": "gw5", "CONFORMANCE_PIN_DEVICES": "1",
         "CONFORMANCE_NUM_DEVICES": "4"}
  plugin.pin_worker_device(env)
  assert env["CUDA_VISIBLE_DEVICES"] == "1"


def test_no_pinning_outside_xdist():
  env = {"CONFORMANCE_PIN_DEVICES": "1"}
  assert plugin.pin_worker_device(env) == {}


def test_child_environ_drops_only_the_device_count():
  env = runner.child_environ({
      "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo=1",
      "OTHER": "x"})
  assert env == {"XLA_FLAGS": "--xla_foo=1", "OTHER": "x"}
  env = runner.child_environ(
      {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
  assert "XLA_FLAGS" not in env


def test_conformance_cli_without_pytest_says_what_to_install():
  """``python -m conformance`` where pytest is missing (a [demo] install):
  one line naming the extra, not a traceback."""
  code = ("import sys; sys.modules['pytest'] = None; import runpy; "
          "runpy.run_module('gram_haiku.conformance', run_name='__main__')")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=False, timeout=120)
  assert out.returncode == 1
  assert "pip install 'gram_haiku[conformance]'" in out.stderr
  assert "Traceback" not in out.stderr


def _plugin_args():
  """``-p gram_haiku.conformance.plugin`` where the entry point is not
  installed (a plain checkout), else nothing."""
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  installed = any(e.value.startswith("gram_haiku.conformance.plugin") for e in
                  importlib.metadata.entry_points(group="pytest11"))
  return [] if installed else ["-p", "gram_haiku.conformance.plugin"]


_MODULES_AFTER_RUN = """
import json, sys
import pytest
status = pytest.main(sys.argv[2:] + ["-q", "-p", "no:cacheprovider",
                                     "test_one.py"])
json.dump({"status": int(status), "modules": sorted(sys.modules)},
          open(sys.argv[1], "w"))
"""


def test_a_one_line_unrelated_test_imports_only_the_plugin(tmp_path):
  """The pytest11 entry point loads in every pytest run of an environment
  with gram_haiku installed: an unrelated test must not pay for JAX. A
  whole pytest run (collection, the run, the terminal summary) of a
  one-line test in a fresh directory imports the same modules with the
  plugin as without it, but for the plugin's own (no JAX, NumPy, Haiku,
  hypothesis), and neither is imported while the test runs: installing
  gram_haiku does not slow it down."""
  (tmp_path / "test_one.py").write_text(
      "import sys\n"
      "def test_one():\n"
      "  assert 'jax' not in sys.modules and 'numpy' not in sys.modules\n")
  (tmp_path / "modules_after_run.py").write_text(_MODULES_AFTER_RUN)
  runs = {}
  for name, flags in (("with", _plugin_args()),
                      ("without", ["-p", "no:gram_haiku_conformance"])):
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, "modules_after_run.py", str(out), "-p", "no:xdist",
         *flags], cwd=tmp_path, capture_output=True, text=True, check=False,
        timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs[name] = json.loads(out.read_text())
    assert runs[name]["status"] == 0, proc.stdout
  added = set(runs["with"]["modules"]) - set(runs["without"]["modules"])
  assert "gram_haiku.conformance.plugin" in added
  assert {m.split(".")[0] for m in added} <= {"gram_haiku"}, sorted(added)
  # (hypothesis's own pytest plugin imports hypothesis, in both runs.)
  for heavy in ("jax", "jaxlib", "numpy", "haiku", "chex", "gram_haiku._src"):
    assert heavy not in runs["with"]["modules"], heavy


# A third party's op, defined and registered outside the repository (the
# op of .ci/third_party.sh).
_MY_OPS = """
import jax
import jax.numpy as jnp

import gram_haiku
from gram_haiku import conformance


def shifted_linear(x, w, c):
  return jnp.dot(x, w) + c


def shifted_linear_gram(x, g, params, example_dim, cfg):
  acc = jnp.promote_types(x.dtype, jnp.float32)
  x = jnp.moveaxis(x, example_dim, 0).astype(acc)
  g = jnp.moveaxis(g, example_dim, 0).astype(acc)
  x = x.reshape(x.shape[0], -1, x.shape[-1])
  g = g.reshape(g.shape[0], -1, g.shape[-1])
  hi = jax.lax.Precision.HIGHEST
  kx = jnp.einsum("itn,jsn->ijts", x, x, precision=hi)
  kg = jnp.einsum("itm,jsm->ijts", g, g, precision=hi)
  gc = g.sum(axis=(1, 2))
  return jnp.sum(kx * kg, axis=(2, 3)) + jnp.outer(gc, gc)


RULE = gram_haiku.Rule(forward=shifted_linear, param_names=("w", "c"),
                       gram=shifted_linear_gram)

conformance.register(conformance.OpSpec.from_rule(
    RULE, name="mine",
    make_params=lambda key, dtype: {
        "w": jax.random.normal(key, (4, 3)).astype(dtype),
        "c": jnp.asarray(0.5, dtype)},
    make_example=lambda key, lead, dtype: jax.random.normal(
        key, lead + (4,)).astype(dtype)))
"""


def _third_party_dir(tmp_path):
  """A directory outside the repository whose conftest.py registers "mine"
  (from a module next to it), as the Conformance page shows."""
  project = tmp_path / "project"
  project.mkdir()
  (project / "my_ops.py").write_text(_MY_OPS)
  (project / "conftest.py").write_text("import my_ops  # registers 'mine'\n")
  return project


def _clean_environ(tmp_path):
  """This run's environment without what would point the child at the
  repository (its root conftest.py is not the third party's), except the
  packages under test: ``PYTHONPATH`` is a directory holding only links to
  this run's ``gram_haiku`` and ``conformance``, so that the child imports
  the same code as this process (a checkout run with ``PYTHONPATH``, not
  another installed copy)."""
  env = runner.child_environ()
  env.pop("PYTHONPATH", None)
  for key in [k for k in env if k.startswith("CONFORMANCE_")]:
    env.pop(key)
  packages = tmp_path / "packages_under_test"
  packages.mkdir(exist_ok=True)
  gram_haiku_dir = os.path.dirname(os.path.dirname(os.path.abspath(
      plugin.__file__)))
  for name in ("gram_haiku", "conformance"):
    source = os.path.join(os.path.dirname(gram_haiku_dir), name)
    if os.path.isdir(source) and not (packages / name).exists():
      (packages / name).symlink_to(source)
  env["PYTHONPATH"] = str(packages)
  return env


@pytest.mark.parametrize("command", [
    ["-m", "gram_haiku.conformance", "--ops", "nope,linear", "-n", "2"],
    ["-m", "pytest", "--pyargs", "gram_haiku.conformance",
     "--conformance-ops", "nope", "-n", "0"],
    ["-W", "ignore::DeprecationWarning", "-m", "conformance", "--ops", "nope",
     "-n", "0"],
], ids=["cli", "pytest", "old-cli"])
def test_an_unknown_op_is_one_message_saying_how_to_register(tmp_path,
                                                             command):
  proc = subprocess.run(
      [sys.executable, *command, *_plugin_args()],
      cwd=_third_party_dir(tmp_path), capture_output=True, text=True,
      check=False, timeout=300, env=_clean_environ(tmp_path))
  text = proc.stdout + proc.stderr
  assert proc.returncode == pytest.ExitCode.USAGE_ERROR, text
  assert text.count("no op is registered as 'nope'") == 1, text
  registered = text.split("Registered ops: ")[1].split("\n")[0]
  assert "linear" in registered and "mine" in registered, text
  assert "conformance.register(conformance.OpSpec(" in text
  assert "--conformance-modules" in text
  for noise in ("Traceback", "length-zero", "collected", "errors",
                "Conformance summary"):
    assert noise not in text, (noise, text)


_MY_FAMILY = """
import jax.numpy as jnp

from gram_haiku import conformance


def check_output_is_finite(spec, scale):
  params = spec.make_params(__import__("jax").random.PRNGKey(0), jnp.float32)
  x = spec.make_example(__import__("jax").random.PRNGKey(1), (4, 2),
                        jnp.float32)
  out = spec.apply(params, jnp.zeros((4, 4)), x * scale)
  assert bool(jnp.all(jnp.isfinite(out))), (spec.name, scale)


conformance.register_check(conformance.Check(
    name="output_is_finite", family="finite", run=check_output_is_finite,
    params=("scale",), cases=[conformance.Case("small", (1e-3,)),
                              conformance.Case("large", (1e3,))]))
"""


def test_the_cli_finds_the_conftest_and_a_third_party_family(tmp_path):
  """``python -m gram_haiku.conformance --ops mine,linear`` run where
  conftest.py registers "mine" and a family of its own (no PYTHONPATH, no
  --conformance-modules; one run for both): mine's cases are collected, and
  the sharded runner, a process of its own started in that directory,
  imports the same module and passes; the family (one record,
  conformance.register_check) gets a test per case of every selected op
  and a row in the table, like the built-in families, and is never
  sampled."""
  project = _third_party_dir(tmp_path)
  (project / "my_family.py").write_text(_MY_FAMILY)
  (project / "conftest.py").write_text("import my_ops\nimport my_family\n")
  proc = subprocess.run(
      [sys.executable, "-m", "gram_haiku.conformance", "--ops", "mine,linear",
       "-n", "0", "-k", "mine and (sharded or frozen) or finite", "-vv",
       *_plugin_args()],
      cwd=project, capture_output=True, text=True, check=False, timeout=600,
      env=_clean_environ(tmp_path))
  text = proc.stdout + proc.stderr
  assert proc.returncode == 0, text
  rows = {tuple(line.split()[:3]): line.split()
          for line in text.split("Conformance summary")[1].splitlines()[2:]
          if line.split()[:1] in (["mine"], ["linear"])}
  sharded = rows[("mine", "sharded", "cpu")]
  assert sharded[3:5] == ["3", "0"], text  # passed, failed
  assert sharded[-1] == "pass", text
  assert ("mine", "frozen", "cpu") in rows, text
  assert not any(op == "linear" and family != "finite"
                 for op, family, _ in rows), text
  for case in ("small", "large"):
    assert f"test_output_is_finite[mine-cpu-{case}] PASSED" in text, text
  assert rows[("mine", "finite", "cpu")][3:5] == ["2", "0"], text
  assert rows[("mine", "finite", "cpu")][-1] == "pass", text
  assert rows[("mine", "finite", "cpu")][7] == "0", text  # never sampled
  assert ("linear", "finite", "cpu") in rows, text
  assert "0 cases deselected" in text


def test_sharded_runner_gets_the_registering_modules_directories(tmp_path):
  pkg = tmp_path / "top" / "pkg"
  pkg.mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "ops.py").write_text("X = 1\n")
  (tmp_path / "flat.py").write_text("Y = 2\n")
  sys.path[:0] = [str(tmp_path / "top"), str(tmp_path)]
  try:
    import flat  # pylint: disable=g-import-not-at-top,import-outside-toplevel,unused-import
    import pkg.ops  # pylint: disable=g-import-not-at-top,import-outside-toplevel,unused-import
    roots = runner.import_roots(["pkg.ops", "pkg", "flat", "not_imported"])
  finally:
    del sys.path[:2]
    for name in ("flat", "pkg", "pkg.ops"):
      sys.modules.pop(name, None)
  assert roots == [str(tmp_path / "top"), str(tmp_path)]
  env = runner.with_import_path({"PYTHONPATH": "/b:/a"}, ["/a", "/c"])
  assert env["PYTHONPATH"] == "/a:/c:/b".replace(":", os.pathsep)
  assert runner.with_import_path({}, []) == {}


def _spec(name, builtin_module=None):
  """An OpSpec whose functions are defined here (a third party's) or, with
  ``builtin_module``, look as if defined in that module."""
  from gram_haiku.conformance import registry  # pylint: disable=g-import-not-at-top
  fns = [lambda *a, **k: None for _ in range(4)]
  if builtin_module:
    for fn in fns:
      fn.__module__ = builtin_module
  return registry.OpSpec(name, *fns)


def test_only_ops_shipped_with_gram_haiku_are_builtin():
  from gram_haiku.conformance import registry  # pylint: disable=g-import-not-at-top
  from gram_haiku.conformance.examples import scaled_linear  # pylint: disable=g-import-not-at-top
  assert all(registry.is_builtin(op) for op in registry.registered_ops()
             if op.name != "mine")
  assert registry.is_builtin(scaled_linear.SPEC)
  assert not registry.is_builtin(_spec("mine"))
  assert registry.is_builtin(_spec("ours", "gram_haiku.conformance.ops.x"))


def test_a_third_party_op_is_never_sampled():
  """Among 16 built-in ops the budget keeps a few cases of each; every
  case of a third party's op runs, however many ops are selected."""
  builtins = [f"op{i}" for i in range(16)]
  items = [_Item(fn, family, op, case)
           for op in builtins + ["mine", "yours"]
           for fn, family, n in (("test_f", "vmap", 6), ("test_s", "sharded",
                                                         3))
           for case in range(n)]
  keep, drop = plugin.sample_items(items, builtins)
  assert drop and all(i.callspec.params["conformance_op"].name in builtins
                      for i in drop)
  for theirs in ("mine", "yours"):
    assert sum(i.callspec.params["conformance_op"].name == theirs
               for i in keep) == 9


def test_each_third_party_op_has_its_own_property_search():
  builtins = [_spec(f"b{i}", "gram_haiku.conformance.ops.x")
              for i in range(3)]
  mine, yours = _spec("mine"), _spec("yours")
  groups = {g.label: g for g in plugin.op_groups(builtins + [mine, yours])}
  assert sorted(groups) == [plugin.BUILTIN_GROUP, "mine", "yours"]
  assert groups["mine"].first == [mine]
  assert yours not in groups["mine"].rest and mine in groups["mine"].rest
  assert groups[plugin.BUILTIN_GROUP].first == builtins
  only = plugin.op_groups([builtins[0]])
  assert [g.label for g in only] == ["b0"]
  assert plugin.op_groups([mine])[0].rest == [mine]


class _Report:

  def __init__(self, op, family, outcome="passed", deselected=0):
    self.user_properties = [
        ("conformance_op", op), ("conformance_family", family),
        ("conformance_platform", "cpu"), ("conformance_absent", ""),
        ("conformance_deselected", deselected)]
    self.when = "call"
    self.failed = outcome == "failed"
    self.skipped = outcome == "skipped"


def test_the_table_marks_sampled_rows_and_counts_the_deselected():
  from gram_haiku.conformance import __main__ as cli  # pylint: disable=g-import-not-at-top
  collector = cli.SummaryCollector()
  for report in (_Report("linear", "vmap", deselected=7),
                 _Report("linear", "vmap", deselected=7),
                 _Report("mine", "vmap"),
                 _Report("mine", "properties", "failed"),
                 _Report(plugin.BUILTIN_GROUP, "properties", deselected=0)):
    collector.pytest_runtest_logreport(report)
  lines = collector.table().splitlines()
  assert lines[0].split() == ["op", "family", "platform", "passed", "failed",
                              "skipped", "xfailed", "deselected", "status"]
  rows = {tuple(l.split()[:2]): l.split() for l in lines[2:-1]}
  assert rows[("linear", "vmap")][3:] == ["2", "0", "0", "0", "7", "pass",
                                          "(sampled)"]
  assert rows[("mine", "vmap")][-2:] == ["0", "pass"]
  assert rows[("mine", "properties")][-1] == "FAIL"
  assert (plugin.BUILTIN_GROUP, "properties") in rows
  assert lines[-1].startswith("7 cases deselected by the default budget")


def test_every_collected_family_has_a_row(tmp_path):
  """Each test function of the suite has a family (so a row in the table):
  the properties search included."""
  del tmp_path
  from gram_haiku.conformance import test_conformance, test_properties, test_sharded  # pylint: disable=g-import-not-at-top,line-too-long
  families = set()
  for module in (test_conformance, test_properties, test_sharded):
    for name in dir(module):
      fn = getattr(module, name)
      if name.startswith("test_") and callable(fn):
        marks = [m for m in getattr(fn, "pytestmark", [])
                 if m.name == "conformance_family"]
        assert marks, f"{module.__name__}.{name} has no family"
        families.add(marks[0].args[0])
  assert families == {"parity", "reference", "vmap", "transforms", "frozen",
                      "bounds", "sharded", "properties"}
  # One registry: every family collected is the registry's, and its checks
  # with a runner of their own are the test functions of their modules.
  from gram_haiku.conformance import families as registry  # pylint: disable=g-import-not-at-top
  assert families == set(registry.families())
  for check in registry.checks():
    module = {"gram_haiku.conformance.test_sharded": test_sharded,
              "gram_haiku.conformance.test_properties": test_properties}.get(
                  check.runner, test_conformance)
    fn = getattr(module, check.test_name)
    marks = [m for m in fn.pytestmark if m.name == "conformance_family"]
    assert marks[0].args[0] == check.family, check


# Two checks of what an import loads, each needing a fresh Python process:
# they share one (a process that imports JAX costs about 2.5 CPU-s), the
# public names' first, before anything has imported JAX.
_PUBLIC_NAMES = (
    "import sys, gram_haiku\n"
    "assert 'jax' not in sys.modules and 'haiku' not in sys.modules\n"
    "gram_haiku.track\n"
    "assert 'jax' in sys.modules\n"
    "assert all(hasattr(gram_haiku, n) for n in gram_haiku.__all__)\n")

_OLD_IMPORT_PATH = (
    "import warnings\n"
    "with warnings.catch_warnings(record=True) as w:\n"
    "  warnings.simplefilter('always')\n"
    "  import conformance\n"
    "  from conformance import checks, testing\n"
    "  from conformance.examples import scaled_linear\n"
    "import gram_haiku.conformance as new\n"
    "from gram_haiku.conformance import checks as new_checks\n"
    "assert checks is new_checks and checks.__spec__.name == "
    "'gram_haiku.conformance.checks'\n"
    "assert conformance.register is new.register\n"
    "assert scaled_linear.SPEC.name == 'example_scaled_linear'\n"
    "msgs = [str(x.message) for x in w if x.category is DeprecationWarning]\n"
    "assert len(msgs) == 1 and 'import gram_haiku.conformance' in msgs[0], "
    "msgs\n"
    # Then, in the same process, `python -m conformance --help`.
    "import runpy, sys\n"
    "sys.argv = ['conformance', '--help']\n"
    "try:\n"
    "  runpy.run_module('conformance', run_name='__main__', "
    "alter_sys=True)\n"
    "except SystemExit as e:\n"
    "  print('exit', e.code)\n")

_PARTS = (("public_names", _PUBLIC_NAMES), ("old_import_path", _OLD_IMPORT_PATH))

_RUN_PARTS = """
import sys, traceback
for name, code in PARTS:
  for stream in (sys.stdout, sys.stderr):
    print(f"=== part {name}", file=stream, flush=True)
  try:
    exec(compile(code, name, "exec"), {"__name__": "__" + name + "__"})
  except BaseException:  # Reported by the part's own test.
    traceback.print_exc()
    print("=== failed", file=sys.stderr, flush=True)
"""


@pytest.fixture(scope="module")
def import_parts():
  """``{part: (failed, stdout, stderr)}`` of :data:`_PARTS`, run in order
  in one fresh Python process."""
  code = f"PARTS = {_PARTS!r}\n{_RUN_PARTS}"
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, check=False, timeout=120)
  assert proc.returncode == 0, proc.stderr

  def split(text):
    chunks = text.split("=== part ")[1:]
    return {c.split("\n", 1)[0]: c.split("\n", 1)[1] for c in chunks}
  out, err = split(proc.stdout), split(proc.stderr)
  return {name: ("=== failed" in err[name], out[name], err[name])
          for name, _ in _PARTS}


def test_the_old_import_path_warns_and_is_the_same_suite(import_parts):
  failed, stdout, stderr = import_parts["old_import_path"]
  assert not failed, stderr
  assert "exit 0" in stdout, stdout + stderr
  assert "python -m gram_haiku.conformance instead" in stderr
  assert "--ops" in stdout


def test_gram_haiku_public_names_load_on_first_use(import_parts):
  """``import gram_haiku`` (what the plugin's import starts with) imports no
  JAX; every name of ``__all__`` is one that loads on first use."""
  import gram_haiku  # pylint: disable=g-import-not-at-top
  assert set(gram_haiku.__all__) == set(gram_haiku._SOURCES)  # pylint: disable=protected-access
  failed, _, stderr = import_parts["public_names"]
  assert not failed, stderr
