"""Benchmark clients for tandem (torch-free): ``tandem bench serve`` lives in :mod:`bench.serve`."""
