"""Deprecated spelling (``pytest --pyargs conformance``): the tests of
:mod:`gram_haiku.conformance.test_sharded`, collected here."""

from gram_haiku.conformance.test_sharded import *  # noqa: F401,F403  pylint: disable=wildcard-import,unused-wildcard-import
