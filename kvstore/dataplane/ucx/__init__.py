"""The UCX plane: tagged transfers on UCX endpoints (RDMA where there is a device, else its
TCP transport). Imports `ucxx` only when a client or server is constructed."""
