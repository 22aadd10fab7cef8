"""Shim for tools that still call setup.py; all metadata is in setup.cfg."""
import setuptools

setuptools.setup()
