"""carton-runner-echo: an example third-party carton runner plugin (runner name ``echo``)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
