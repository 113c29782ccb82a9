"""Bounded memories of what was read from heads, keyed by a head's exact bytes.

Reading a head (the raw-head guard's pass, a parse) is a pure function of its bytes, and a child
sends the same head again and again (one client library, one registry, one token), a server answers
with the same head: the same bytes again are the same answer, without a look at them. Every such
memory holds at most REMEMBERED_HEADS heads of up to REMEMBERED_HEAD bytes and is forgotten all at
once when full (constant time, no order to keep). What raised is never kept: a head to refuse is
read, and refused, each time."""

REMEMBERED_HEAD = 2048  # bytes of a head remembered, at most
REMEMBERED_HEADS = 256  # heads remembered by one memory, at most


class HeadMemory[V](dict[bytes, V]):
    """Looked up as the dict it is (`get`, `in`: no Python frame on the way of a head read before);
    filled through `keep`, which holds the bounds."""

    __slots__ = ()

    def keep(self, head: bytes, value: V) -> V:
        """value, remembered for head when head is short enough to be."""
        if len(head) <= REMEMBERED_HEAD:
            if len(self) >= REMEMBERED_HEADS:
                self.clear()
            self[head] = value
        return value
