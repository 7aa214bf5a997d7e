"""The same-host plane: shared memory and sockets between the ranks of one
host, and which ranks share a host."""
