"""Helpers for tests and scripts that run mori-jit ops (a multi-process launcher); not needed to use them."""
