"""``python -m carton.server._child FD PARENT_PID``: one of the server processes a ``carton serve --processes N``
coordinator starts (see `carton.server._processes`)."""

import sys

from ._processes import child_main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
