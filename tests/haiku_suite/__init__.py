"""Haiku's own tests with gram_haiku.track() around every transform.

Run ``python -m tests.haiku_suite`` (see __main__.py); not collected by the
default ``python -m pytest`` run.
"""
