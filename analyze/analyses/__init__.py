"""Analyses of the cache, one module each."""
