"""pytest plugin: Haiku's own tests, every transform tracked (see patch.py).

Loaded with ``-p tests.haiku_suite.plugin`` by ``python -m
tests.haiku_suite`` (never by the default ``python -m pytest`` run).

* Every test runs with its transformed functions inside ``gram_haiku.track()``
  and the probe entries kept in the state they return: it must pass.
* A test listed in ``allowlist.txt`` differs from plain Haiku in a documented
  way, named by its entry's kind:

  - ``state``: only by the probe entries (it compares or counts state). It
    runs with the probes left out of the state it sees, and must then pass.
  - ``jaxpr``: it inspects the traced program, where a tracked layer is one
    hijax primitive (inlined when lowered: the compiled program is the
    plain one's). It must fail (a strict xfail).

* ``--haiku-check-allowlist`` runs only the ``state`` entries, with the
  probes kept, and expects each to fail (a strict xfail): an entry that
  passes is stale, and so is one that matches no test of a collected module.
* ``--haiku-plain``: no tracking (the baseline on this machine).
"""

from __future__ import annotations

import fnmatch
import os
import sys

import haiku as hk
import pytest

from gram_haiku._src.frontend import registry

ALLOWLIST = os.path.join(os.path.dirname(__file__), "allowlist.txt")
KINDS = ("state", "jaxpr")

_STRIP = pytest.StashKey[bool]()


def load_allowlist(path: str = ALLOWLIST) -> dict:
  """``{test id pattern: (kind, reason)}`` from ``id  kind: reason`` lines
  (``#`` starts a comment line)."""
  entries = {}
  with open(path) as f:
    for line in f:
      line = line.strip()
      if line and not line.startswith("#"):
        key, _, rest = line.partition(" ")
        kind, _, reason = rest.strip().partition(":")
        if kind not in KINDS:
          raise ValueError(f"allowlist.txt: {key}: kind {kind!r} is not one "
                           f"of {KINDS}")
        entries[key] = (kind, reason.strip())
  return entries


def suite_id(item) -> str:
  """``haiku._src.bias_test::BiasTest::test_bias_dims``: stable ids."""
  return f"{item.module.__name__}::{item.nodeid.split('::', 1)[1]}"


def _entry(allowed: dict, key: str):
  for pattern, entry in allowed.items():
    if fnmatch.fnmatchcase(key, pattern):
      return pattern, entry
  return None, None


def pytest_addoption(parser):
  group = parser.getgroup("haiku_suite",
                          "Haiku's tests under gram_haiku.track()")
  group.addoption("--haiku-plain", action="store_true",
                  help="run Haiku's tests without track() (the baseline)")
  group.addoption("--haiku-check-allowlist", action="store_true",
                  help="run only the allowlisted state tests, probes kept; "
                  "each must fail")


def pytest_configure(config):
  if not config.getoption("haiku_plain"):
    from tests.haiku_suite import patch  # pylint: disable=g-import-not-at-top
    patch.install()


@pytest.hookimpl(tryfirst=True)  # Before -k/-m: sees every collected test.
def pytest_collection_modifyitems(config, items):
  if config.getoption("haiku_plain"):
    return
  allowed = load_allowlist()
  check = config.getoption("haiku_check_allowlist")
  used, kept, deselected = set(), [], []
  for item in items:
    pattern, entry = _entry(allowed, suite_id(item))
    if pattern is not None:
      used.add(pattern)
    kind, reason = entry or (None, None)
    if check and kind != "state":
      deselected.append(item)
      continue
    kept.append(item)
    if kind == "jaxpr" or check:
      item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    elif kind == "state":
      item.stash[_STRIP] = True
  modules = {item.module.__name__ for item in items}
  stale = [p for p in allowed if p not in used and p.split("::")[0] in modules]
  if stale:
    raise pytest.UsageError(
        "allowlist.txt entries that match no collected test: " +
        ", ".join(stale))
  if deselected:
    config.hook.pytest_deselected(items=deselected)
    items[:] = kept


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
  if item.config.getoption("haiku_plain"):
    return (yield)
  from tests.haiku_suite import patch  # pylint: disable=g-import-not-at-top
  patch.strip = item.stash.get(_STRIP, False)
  try:
    return (yield)
  finally:
    patch.strip = False
    _restore_tracked_classes()


def _restore_tracked_classes():
  """Puts Haiku's tracked module classes back where a test reloaded them.

  ``mixed_precision_test`` reloads ``haiku._src.conv``: its new ``ConvND``,
  ``Conv2D``, ... have no layer handler, so every later test in the process
  would run them untracked (reported as untracked parameters, and then
  passing trivially). ``hk``'s names still hold the registered classes.
  """
  for cls in vars(hk).values():
    if isinstance(cls, type) and registry.handler_for(cls) is not None:
      module = sys.modules.get(cls.__module__)
      if module is not None and getattr(module, cls.__name__, cls) is not cls:
        setattr(module, cls.__name__, cls)


def pytest_terminal_summary(terminalreporter, config):
  if config.getoption("haiku_plain") or getattr(config, "workerinput", None):
    return
  if config.pluginmanager.hasplugin("dsession"):
    return  # xdist: the workers count.
  from tests.haiku_suite import patch  # pylint: disable=g-import-not-at-top
  terminalreporter.write_line(
      f"haiku_suite: {patch.probed_calls} tracked init/apply calls "
      "returned gram_probe entries")
