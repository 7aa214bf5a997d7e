"""Transport: the bytes between ranks over gRPC, and their framing, integrity
and authentication. Algorithms see only the interface in streams.py."""
