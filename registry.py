"""The one registry type: named declarations of one sort (the measurements,
``layerdiv.measurements.registry``; the analyses, ``layerdiv.analyze.registry``), those of an
entry point group first, loaded once per process on first use, then those registered in code;
looked up by name."""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Generic, TypeVar

from layerdiv.errors import LayerdivError

T = TypeVar("T")


class UnknownName(LayerdivError, ValueError):
    """A name that no registered declaration has."""


def loaded(
    group: str,
    taken: Container[str],
    failed: Callable[[EntryPoint, Exception], None] | None = None,
) -> list[tuple[EntryPoint, Any]]:
    """The entry points of ``group`` but those whose name is in ``taken``, each with the object it
    names, loaded: layerdiv's own (its built-ins) first, by their ``order`` (an installed
    distribution lists its entry points by name), then other distributions', as they come.
    Another distribution's entry point that fails to load goes to ``failed`` (where given) and
    is left out; otherwise, and for layerdiv's own, the error is raised."""
    found: dict[tuple[str, str], EntryPoint] = {}  # a distribution found twice lists it twice
    for entry in entry_points(group=group):
        if entry.name not in taken:
            found.setdefault((entry.name, entry.value), entry)
    items: list[tuple[bool, EntryPoint, Any]] = []
    for entry in found.values():
        plugin = entry.dist is None or entry.dist.name != "layerdiv"
        try:
            items.append((plugin, entry, entry.load()))
        except Exception as err:
            if failed is None or not plugin:
                raise
            failed(entry, err)
    items.sort(key=lambda i: (i[0], 0 if i[0] else i[2].order))
    return [(entry, obj) for _, entry, obj in items]


class Registry(Generic[T]):
    """The declarations of one sort by name, in registration order. ``add`` registers the object
    an entry point of ``group`` names (the sort's own checks, then :meth:`put`); ``failed``
    takes another distribution's entry point that fails to load (:func:`loaded`)."""

    def __init__(
        self,
        sort: str,
        group: str,
        add: Callable[[EntryPoint, Any], object],
        failed: Callable[[EntryPoint, Exception], None] | None = None,
    ) -> None:
        self.sort = sort
        """What a declaration is called in messages (``measurement``, ``analysis``)."""
        self.group = group
        """The entry point group its declarations come through."""
        self.by_name: dict[str, T] = {}
        """The declarations registered so far (without loading the entry points)."""
        self._add, self._failed = add, failed
        self._loaded = False

    def load(self) -> None:
        """Register, once per process, the declarations of the entry point group (a name
        registered already is left as it is)."""
        if not self._loaded:
            self._loaded = True
            for entry, obj in loaded(self.group, self.by_name, self._failed):
                self._add(entry, obj)

    def put(self, name: str, item: T) -> None:
        """Register ``item`` under ``name`` (after the sort's own checks), the entry points
        first."""
        self.load()
        self.by_name[name] = item

    def remove(self, name: str) -> None:
        """Unregister ``name`` (tests)."""
        self.by_name.pop(name, None)

    def get(self, name: str) -> T | None:
        """The declaration named ``name``; None where none is."""
        self.load()
        return self.by_name.get(name)

    def __getitem__(self, name: str) -> T:
        """The declaration named ``name``; refuses (:class:`UnknownName`) one that none has."""
        item = self.get(name)
        if item is None:
            raise UnknownName(
                f"no {self.sort} named {name!r}; the {self.sort} names are "
                f"{', '.join(self.by_name) or 'none'}"
            )
        return item

    def __contains__(self, name: object) -> bool:
        self.load()
        return name in self.by_name

    def __iter__(self) -> Iterator[T]:
        """The declarations, in registration order."""
        self.load()
        return iter(list(self.by_name.values()))
