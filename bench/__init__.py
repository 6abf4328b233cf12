"""Benchmark clients for tandem (torch-free): ``tandem bench serve`` lives in :mod:`tandem.bench.serve`."""
