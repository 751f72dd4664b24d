"""The built-in analyses, one module each, registered in this order (see
:mod:`layerdiv.analyze.registry`). A new analysis is one module here plus one import line."""

# isort: skip_file
# Registration order is import order, the order of the report's sections (an analysis that reads
# another's tables says so in its `after`).
from layerdiv.analyze.analyses import paper
from layerdiv.analyze.analyses import depth
from layerdiv.analyze.analyses import gram
from layerdiv.analyze.analyses import skips
from layerdiv.analyze.analyses import heads
from layerdiv.analyze.analyses import reweight
from layerdiv.analyze.analyses import lens
from layerdiv.analyze.analyses import text_geometry
from layerdiv.analyze.analyses import text_lens
from layerdiv.analyze.analyses import text_skips
from layerdiv.analyze.analyses import text_profiles
from layerdiv.analyze.analyses import text_groups
from layerdiv.analyze.analyses import effective_depth
from layerdiv.analyze.analyses import decided_depth
from layerdiv.analyze.analyses import igrad
from layerdiv.analyze.analyses import erasure
from layerdiv.analyze.analyses import sinks
from layerdiv.analyze.analyses import revisions
from layerdiv.analyze.analyses import depth_law
from layerdiv.analyze.analyses import maps

__all__ = [
    "decided_depth",
    "depth",
    "depth_law",
    "effective_depth",
    "erasure",
    "gram",
    "heads",
    "igrad",
    "lens",
    "maps",
    "paper",
    "revisions",
    "reweight",
    "sinks",
    "skips",
    "text_geometry",
    "text_groups",
    "text_lens",
    "text_profiles",
    "text_skips",
]
