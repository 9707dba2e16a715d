"""``python -m carton_protocol``: the runner-side loop (see `carton_protocol._loop`)."""

from ._loop import main

raise SystemExit(main())
