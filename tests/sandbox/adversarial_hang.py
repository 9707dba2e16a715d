"""A runner module whose import never finishes, so the runner never answers the handshake."""

from __future__ import annotations

import time

from carton_protocol import Runner

while True:
    time.sleep(1)


class Never(Runner):
    """Never defined: the import above does not return."""
