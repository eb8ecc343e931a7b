"""The session: `offload()` and `Session`, what `offload` checks in its arguments, auto in a session
(the `Chooser`, `SessionReport`) and the open sessions by pipeline behind `session_of`."""

from __future__ import annotations

# The names the package root and load/ use: they enter this room only here.
from torchferry.session._chooser import SessionReport as SessionReport
from torchferry.session._options import unknown_options as unknown_options
from torchferry.session._session import Session as Session
from torchferry.session._session import offload as offload
from torchferry.session._session import session_of as session_of
