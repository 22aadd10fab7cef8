"""Deprecated spelling (``pytest --pyargs conformance``): the tests of
:mod:`gram_haiku.conformance.test_properties`, collected here."""

from gram_haiku.conformance.test_properties import *  # noqa: F401,F403  pylint: disable=wildcard-import,unused-wildcard-import
