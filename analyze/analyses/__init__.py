"""The built-in analyses of the core tables, one module each (those of a measurement's tables are
in its folder, ``layerdiv.measurements.<name>``). Each is registered through an entry point of
``pyproject.toml`` (group ``layerdiv.analyses``); their ``order`` is the order of the report's
sections (an analysis that reads another's tables says so in its ``after``); see
:mod:`layerdiv.analyze.registry`."""
