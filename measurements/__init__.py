"""The optional measurements of an extraction (:mod:`layerdiv.measurements.registry`), one module
each; importing this package registers the built-in ones, in the order of the ``extract``
options."""

# isort: skip_file
# Registration order is import order (the order of the optional tables everywhere).
from layerdiv.measurements import skips  # noqa: F401
from layerdiv.measurements import heads  # noqa: F401
from layerdiv.measurements import gram  # noqa: F401
from layerdiv.measurements import lens  # noqa: F401
from layerdiv.measurements import future  # noqa: F401
from layerdiv.measurements import states  # noqa: F401
from layerdiv.measurements import igrad  # noqa: F401
from layerdiv.measurements import erase  # noqa: F401
from layerdiv.measurements import sinks  # noqa: F401
from layerdiv.measurements.registry import (
    ENTRY_POINTS,
    AnswerSpan,
    Attachment,
    Capture,
    DecompositionCapture,
    GradientCapture,
    Measurement,
    MeasurementError,
    ModelShape,
    PartitionCapture,
    Planning,
    RowsCapture,
    Setting,
    all_optional_tables,
    answer_spans,
    for_kind,
    kind_of_table,
    measurement_of,
    optional_tables,
    register,
    registered,
    ruled_tables,
    table_name_problem,
    table_rules,
    table_schemas,
    tables_of_kind,
    unregister,
)

__all__ = [
    "ENTRY_POINTS",
    "AnswerSpan",
    "Attachment",
    "Capture",
    "DecompositionCapture",
    "GradientCapture",
    "Measurement",
    "MeasurementError",
    "ModelShape",
    "PartitionCapture",
    "Planning",
    "RowsCapture",
    "Setting",
    "all_optional_tables",
    "answer_spans",
    "for_kind",
    "kind_of_table",
    "measurement_of",
    "optional_tables",
    "register",
    "registered",
    "ruled_tables",
    "table_name_problem",
    "table_rules",
    "table_schemas",
    "tables_of_kind",
    "unregister",
]
