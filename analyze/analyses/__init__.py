"""Registered analyses, imported in report order."""
