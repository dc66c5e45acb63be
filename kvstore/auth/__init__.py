"""Who may call a node: bearer tokens mapped to tenants (`TokenTable`), checked on every
call (`Authenticator`), TLS for the listening side (`server_credentials`) and the channel a
client opens with its token and trust roots (`open_channel`, `open_aio_channel`)."""

from kvstore.auth.authenticator import ANONYMOUS, Authenticator
from kvstore.auth.channels import open_aio_channel, open_channel, read_token_file
from kvstore.auth.exposure import check_exposure, is_loopback
from kvstore.auth.interceptor import TokenInterceptor
from kvstore.auth.listener import ListenerSecurity, add_port, check_listener, read_tokens
from kvstore.auth.tls import server_credentials
from kvstore.auth.tokens import TokenTable

__all__ = [
    "ANONYMOUS",
    "Authenticator",
    "ListenerSecurity",
    "TokenInterceptor",
    "TokenTable",
    "add_port",
    "check_exposure",
    "check_listener",
    "is_loopback",
    "open_aio_channel",
    "open_channel",
    "read_token_file",
    "read_tokens",
    "server_credentials",
]
