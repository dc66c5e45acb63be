"""The routing and admission policies, one module per family; `kvstore.conductor.registry`
names them."""
