"""The version of carton (the distribution and both packages it installs)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
