"""The store node: `kvstore serve`. Its gRPC service (`servicer`) and data planes call the
store core with the caller resolved by `kvstore.tenancy`; `server` builds and runs it all."""
