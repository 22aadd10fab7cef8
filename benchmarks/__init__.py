"""Benchmarks of gram_haiku: ``python -m benchmarks --help``.

Suites: ``models`` (MLP, CNN, transformer LM, LSTM x plain / tracked Gram /
tracked norms / naive ``vmap(grad)``, and the torch peers with the
``bench-torch`` extra), ``scaling`` (batch and sequence sweeps) and
``real`` (WRN-16-4, ViT-S/4 and a GPT-2-style decoder against jax-privacy:
:mod:`benchmarks.realistic`). See
``benchmarks/README.md`` for the protocol and the measured numbers
(``docs/performance.rst``: what users need of them).
"""
