"""Sharded vs single device, from :mod:`gram_haiku.conformance.sharded` (a
process of its own).

The runner starts once per pytest run, however many xdist workers there are
(:mod:`gram_haiku.conformance.runner`).
"""


import pytest

from gram_haiku.conformance import plugin
from gram_haiku.conformance import registry
from gram_haiku.conformance import runner
from gram_haiku.conformance import sharded

pytestmark = pytest.mark.conformance


def _kept_cases(session) -> str:
  """``op:layout`` pairs of the session's (sampled) sharded tests, sorted:
  every xdist worker collects the same items, so the one runner they share
  gets the same arguments from each."""
  pairs = set()
  for item in session.items:
    if item.originalname == "test_sharded_equals_single_device":
      params = item.callspec.params
      pairs.add(f"{params['conformance_op'].name}:{params['layout']}")
  return ",".join(sorted(pairs))


@pytest.fixture(scope="session")
def sharded_records(tmp_path_factory, pytestconfig, request):
  ops = [op.name for op in plugin.selected_ops(pytestconfig)]
  modules = sorted(set(registry.registering_modules(ops)) | set(
      plugin.extra_modules(pytestconfig)))
  # The runner imports the modules that registered the ops from where this
  # process found them, and starts in the directory pytest was run from.
  env = runner.with_import_path(runner.child_environ(),
                                runner.import_roots(modules))
  return runner.run_once(
      "conformance-sharded",
      runner.python_cmd("gram_haiku.conformance.sharded",
                        "--ops", ",".join(ops), "--modules", ",".join(modules),
                        "--cases", _kept_cases(request.session),
                        "--platforms", ",".join(plugin.present_platforms())),
      tmp_path_factory, env=env,
      cwd=str(pytestconfig.invocation_params.dir))


@pytest.mark.conformance_family("sharded")
@pytest.mark.parametrize("layout", sharded.LAYOUTS)
def test_sharded_equals_single_device(conformance_op, conformance_platform,
                                      layout, sharded_records):
  records = {(r["op"], r["layout"], r["platform"]): r
             for r in sharded_records.get()}
  rec = records.get((conformance_op.name, layout, conformance_platform))
  assert rec is not None, "the sharded runner produced no record"
  if rec["status"] == "skip":
    pytest.skip(rec["reason"])
  if rec["status"] == "fail":
    pytest.fail(f"{rec['error']}\n{rec.get('traceback', '')}")
