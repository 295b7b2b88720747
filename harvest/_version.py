"""The version, defined here only: pyproject.toml and the docs read it from this file."""

__version__ = "0.2.0.dev0"
