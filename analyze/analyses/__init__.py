"""The built-in analyses, one module each, registered in this order (see
:mod:`layerdiv.analyze.registry`). A new analysis is one module here plus one import line."""

# The import order is the registration order.
# isort: off
from layerdiv.analyze.analyses import paper
from layerdiv.analyze.analyses import heads

# isort: on

__all__ = ["heads", "paper"]
