"""The release, read by the package root and by what a joiner and its job compare."""

__version__ = "0.1.0"
