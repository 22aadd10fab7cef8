"""Benchmarks of gram_haiku: ``python -m benchmarks --help``.

Suites: ``models`` (MLP, CNN, transformer LM, LSTM x plain / tracked Gram /
tracked norms / naive ``vmap(grad)``, and the torch peers with the
``bench-torch`` extra) and ``scaling`` (batch and sequence sweeps). See
``docs/performance.rst`` for the protocol and the measured numbers.
"""
