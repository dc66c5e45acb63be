"""What the two socket planes (`shm`, `tcp`) share: the request messages, a connection's
calls in order, and the server's accept loop with its bound on unproven sockets."""
