"""Extraction stage: run a causal LM once per task and cache every component's option logits."""
