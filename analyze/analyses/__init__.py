"""The built-in analyses, one module each, registered in this order (see
:mod:`layerdiv.analyze.registry`). A new analysis is one module here plus one import line."""

from layerdiv.analyze.analyses import paper

__all__ = ["paper"]
