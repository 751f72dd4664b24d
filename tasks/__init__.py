"""Built-in task definitions (one YAML per task); loaded by ``layerdiv.extract.tasks``."""
