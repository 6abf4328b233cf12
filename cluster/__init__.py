"""The bottom layer, torch-free, that every process shares: wire messages, Redis keys,
the worker registry, settings and the scheduling policies. It imports nothing else of
tandem's."""
