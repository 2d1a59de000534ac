"""The package's version (one place: the package and the command line read it)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
