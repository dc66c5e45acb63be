"""The TCP plane: block bytes on a stream socket, copied once by the kernel."""
