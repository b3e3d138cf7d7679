"""Bearer tokens: constant-time lookup, principals, refusal of anything malformed."""

from __future__ import annotations

import pytest

from psg_server.errors import AuthenticationError
from psg_server.security import ANONYMOUS, TokenAuthenticator

TOKENS = {"alice-token-0123456789": "alice", "bob-token-0123456789xx": "bob"}


def test_known_tokens_name_their_principal() -> None:
    auth = TokenAuthenticator(TOKENS)
    assert auth.enabled
    assert auth.principal((("x-other", "1"), ("authorization", "Bearer alice-token-0123456789"))) == "alice"
    assert auth.principal((("authorization", b"bearer bob-token-0123456789xx"),)) == "bob"


@pytest.mark.parametrize("metadata, message", [
    ((), "missing 'authorization"),
    (None, "missing 'authorization"),
    ((("authorization", "Basic YWxpY2U6cHc="),), "one 'Bearer <token>'"),
    ((("authorization", "Bearer alice-token-0123456789"), ("authorization", "Bearer x")), "one 'Bearer"),
    ((("authorization", "Bearer alice-token-012345678"),), "unknown bearer token"),
    ((("authorization", "Bearer "),), "unknown bearer token"),
])
def test_missing_malformed_and_unknown_tokens_are_refused(metadata: object, message: str) -> None:
    with pytest.raises(AuthenticationError, match=message):
        TokenAuthenticator(TOKENS).principal(metadata)  # type: ignore[arg-type]


def test_without_tokens_everyone_is_anonymous() -> None:
    auth = TokenAuthenticator({})
    assert not auth.enabled and auth.principal(()) == ANONYMOUS
