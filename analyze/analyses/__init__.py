"""The built-in analyses, registered in this order (see :mod:`layerdiv.analyze.registry`): those
of the core tables are modules here, those of a measurement's tables are in its folder
(``layerdiv.measurements.<name>``)."""

# isort: skip_file
# Registration order is import order, the order of the report's sections (an analysis that reads
# another's tables says so in its `after`).
from layerdiv.analyze.analyses import paper
from layerdiv.analyze.analyses import depth
from layerdiv.measurements.gram import analysis as gram
from layerdiv.measurements.skips import analysis as skips
from layerdiv.measurements.heads import analysis as heads
from layerdiv.measurements.heads import reweight
from layerdiv.measurements.lens import analysis as lens
from layerdiv.analyze.analyses import text_geometry
from layerdiv.measurements.lens import text_lens
from layerdiv.measurements.future import analysis as text_skips
from layerdiv.analyze.analyses import text_profiles
from layerdiv.measurements.future import text_groups
from layerdiv.analyze.analyses import effective_depth
from layerdiv.measurements.lens import decided_depth
from layerdiv.measurements.igrad import analysis as igrad
from layerdiv.measurements.erase import analysis as erasure
from layerdiv.measurements.sinks import analysis as sinks
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
