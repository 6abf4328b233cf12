"""Decode pool: capacity scheduler, decode loop, token publishing, worker entry point."""
