"""The errors extraction reports to the user as one line (the CLI prints them, exit code 1)."""

from layerdiv.extract.adapters import UnsupportedModel
from layerdiv.extract.capture import DecompositionError
from layerdiv.extract.models import ModelLoadError
from layerdiv.extract.tasks import TaskError
from layerdiv.schemas import SchemaError
from layerdiv.store.writer import StoreConflict

EXTRACT_ERRORS = (
    DecompositionError,
    ModelLoadError,
    SchemaError,
    StoreConflict,
    TaskError,
    UnsupportedModel,
)
