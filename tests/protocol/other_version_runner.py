"""Run the real runner loop, but speaking another protocol version (argv: the loop's own arguments)."""

import sys

import carton_protocol._loop as loop

loop.PROTOCOL_VERSION = 99
raise SystemExit(loop.main(sys.argv[1:]))
