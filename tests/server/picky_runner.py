"""A third-party runner for the server tests (entry ``picky_runner:Picky``): doubles ``x``, and refuses on purpose.

Negative values are the client's mistake (`carton_protocol.InvalidInput`, naming the tensor); values over a million
are the model's own failure (a plain `ValueError`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from carton_protocol import InvalidInput, Runner, Tensor


class Picky(Runner):
    concurrent = True

    def infer(self, inputs: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        x = inputs["x"]
        assert isinstance(x, np.ndarray)
        if (x < 0).any():
            raise InvalidInput(f"input 'x' must not be negative, got {float(x.min())}", tensor="x")
        if (x > 1e6).any():
            raise ValueError("this model cannot count that high")
        return {"y": x * 2}
