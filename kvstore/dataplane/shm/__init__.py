"""The same-host plane: block bytes copied through memory shared with the node, requests
over an abstract Unix socket."""
