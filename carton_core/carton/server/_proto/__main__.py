"""``python -m carton.server._proto``: compile the gRPC protocol now and print where the descriptor set is."""

from . import compile_descriptor_set

print(compile_descriptor_set())
