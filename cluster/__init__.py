"""Torch-free pieces every process shares: wire messages, Redis keys, the worker
registry, settings, and the ``tandem`` command line."""
