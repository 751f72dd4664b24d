"""Analysis stage: decompositions, curves, correlations and reports from the cache alone."""
