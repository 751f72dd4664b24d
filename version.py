"""The package's version (one place: the package, its reports and ``--version`` read it here)."""

__version__ = "0.1.0"
