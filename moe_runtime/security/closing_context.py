"""A ZeroMQ context that closes its own sockets before it terminates, also when it is collected unclosed.

pyzmq's `Context.__del__` destroys the context: it closes the sockets it still knows of (a weak set) and then
terminates, which waits until every socket of the context is closed. When the owner of a context and its sockets
dies in a reference cycle without `close()` (an exception raised from the owner's `__init__` and kept by a caller's
traceback is enough), the garbage collector clears the weak set before any finalizer runs, the context's finalizer
may run before the sockets', and the termination waits forever: the process hangs inside an unrelated allocation
that happened to trigger the collection. This context holds its sockets strongly and closes them (linger 0 when
collected) before terminating, so no order of finalizers can hang.
"""
from __future__ import annotations

import zmq


class ClosingContext(zmq.Context):
    """`zmq.Context` whose `destroy` (called by its finalizer too) first closes every socket made from it."""

    _held: list[zmq.Socket] | None = None   # declared on the class: pyzmq takes unknown attributes for options

    def __init__(self) -> None:
        super().__init__()
        self._held: list[zmq.Socket] = []

    def socket(self, socket_type: int, socket_class: type | None = None, **kwargs) -> zmq.Socket:
        made = super().socket(socket_type, socket_class, **kwargs)
        self._held = [held for held in self._held if not held.closed]
        self._held.append(made)
        return made

    def destroy(self, linger: int | None = None) -> None:
        for held in self._held or ():
            if not held.closed:
                held.close(linger=0 if linger is None else linger)
        super().destroy(linger=linger)
