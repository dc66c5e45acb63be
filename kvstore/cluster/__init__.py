"""The global pool across nodes, on Redis or Redis Cluster: membership (`membership`), the
block index (`global_index`) and the thread that keeps this node's part of both up to date
(`publisher`), over a connection with short timeouts (`redis_link`). Only nodes talk to
Redis; clients ask a node."""
