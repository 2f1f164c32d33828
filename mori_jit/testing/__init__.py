"""Helpers for tests and tools that run mori-jit ops (a multi-process launcher); not needed to use them."""
