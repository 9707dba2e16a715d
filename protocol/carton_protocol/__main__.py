"""``python -m carton_protocol``: fork the runner under its supervisor, then run the runner-side loop.

`carton_protocol._supervisor.supervise` runs first, before numpy or pyzmq are imported (the package ``__init__``
imports nothing until a name is used): the process the host started stays behind as the runner's reaper, and only
the forked child goes on to `carton_protocol._loop`.
"""

from ._supervisor import supervise


def _run() -> int:
    supervise()  # returns in the runner child only
    from ._loop import main

    return main()


raise SystemExit(_run())
