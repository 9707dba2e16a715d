"""The Carton v1 package format: reading (zip, directory, URL), verifying, materializing, writing, shrinking.

See docs/format.md. `get_model_info` and `open_carton` never trust the archive: the zip structure is validated
before anything is read, and every file is checked against MANIFEST before it is handed out.
"""

from ._info import CartonInfo, Example, MiscRef, RunnerInfo, SelfTest, TensorRef
from ._limits import DEFAULT_LIMITS, ReadLimits
from ._open import OpenedCarton, Verification, open_carton
from ._pack import CartonContents, check_links, check_specs, compression_method, default_output, shrink, write_carton
from ._reader import get_model_info
from ._verify import verify

__all__ = [
    "DEFAULT_LIMITS",
    "CartonContents",
    "CartonInfo",
    "Example",
    "MiscRef",
    "OpenedCarton",
    "ReadLimits",
    "RunnerInfo",
    "SelfTest",
    "TensorRef",
    "Verification",
    "check_links",
    "check_specs",
    "compression_method",
    "default_output",
    "get_model_info",
    "open_carton",
    "shrink",
    "verify",
    "write_carton",
]
