"""The built-in analyses, one module each, registered in this order (see
:mod:`layerdiv.analyze.registry`). A new analysis is one module here plus one import line."""

# isort: skip_file
# Registration order is import order: the paper's analysis first, the others after it.
from layerdiv.analyze.analyses import paper
from layerdiv.analyze.analyses import depth
from layerdiv.analyze.analyses import heads

__all__ = ["depth", "heads", "paper"]
