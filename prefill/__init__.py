"""Prefill pool: chunked-context scheduler, prefill loop, worker entry point."""
