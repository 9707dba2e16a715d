"""The public entry points that combine the package format, the runtime and the sandbox: `load`,
`load_unpacked` and `pack` (docs/architecture.md, "Layers")."""

from ._load import load, load_unpacked
from ._pack import pack

__all__ = ["load", "load_unpacked", "pack"]
