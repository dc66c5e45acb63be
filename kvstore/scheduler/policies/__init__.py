"""The routing and admission policies, one module per family; `kvstore.scheduler.registry`
names them."""
