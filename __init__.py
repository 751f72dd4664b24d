"""layerdiv: how the layers of a language model add up to its prediction.

Two stages: ``layerdiv.extract`` runs a model once per task and caches every residual component's
option logits (needs torch); ``layerdiv.analyze`` computes the bias-diversity decompositions and
curves from that cache alone (no torch). ``layerdiv.store`` owns the cache's files and
``layerdiv.schemas`` its versioned columns.
"""

__version__ = "0.1.0"
